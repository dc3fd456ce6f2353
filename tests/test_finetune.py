"""The recipe step sequence (``recipes.finetune``) once, on tiny-llama; ``recipe=sft`` with LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

from fastdecode.config import CONFIG_DIR, ConfigError
from fastdecode.runtime.loading import load_model
from recipes.common import TrainJob, load_job
from recipes.finetune import FinetuneRun, Recipe, finetune
from recipes.sft import SFT
from tests.helpers import model_tolerance, write_chat_jsonl


def _job(tmp_path: Path, *extra: str) -> tuple[TrainJob, object]:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)
    overrides = [
        "recipe=sft",
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=2",
        "trainer.max_steps=2",
        "trainer.save_steps=2",
        "trainer.logging_steps=1",
        "trainer.warmup_steps=0",
        f"output_dir={tmp_path / 'run'}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    return load_job(cfg), cfg


class Recording(Recipe):
    """The default (SFT) recipe, every hook recorded, each after-training hook adding a summary field."""

    def __init__(self, job: TrainJob) -> None:
        super().__init__(job)
        self.calls: list[str] = []

    def prepare(self) -> None:
        self.calls.append("prepare")

    def validate(self, config) -> None:
        self.calls.append("validate")
        assert config.num_hidden_layers == 4 and not hasattr(
            config, "peft_config"
        )  # the HF config, no weights

    def datasets(self, tokenizer):
        self.calls.append("datasets")
        return super().datasets(tokenizer)

    def module(self, model, args):
        self.calls.append("module")
        return super().module(model, args)

    def summary(self) -> dict:
        self.calls.append("summary")
        return {"known_before": 1}

    def before_report(self, model, tokenizer, held_out):
        self.calls.append("before_report")
        return {"held_out": len(held_out)}

    def after_report(self, run: FinetuneRun) -> dict:
        self.calls.append("after_report")
        assert run.final is not None  # rank 0, after the export
        return {"after": {"before": run.before}}

    def extra_files(self, run: FinetuneRun) -> dict:
        self.calls.append("extra_files")
        (run.stage / "extra.json").write_text("{}")  # the export staging directory: final/ appears whole
        return {"extra": str(run.out / "final" / "extra.json")}


def test_finetune_runs_the_hooks_in_order_and_writes_the_summary(tmp_path):
    job, cfg = _job(tmp_path, "trainer.max_steps=1")
    recipe = Recording(job)
    run = finetune(job, cfg, recipe)
    assert recipe.calls == [
        "prepare",
        "validate",
        "datasets",
        "before_report",
        "module",  # the module the Trainer trains
        "summary",
        "module",  # the same module around the exported checkpoint: the export check
        "after_report",
        "extra_files",
    ]
    out = tmp_path / "run"
    saved = json.loads((out / "summary.json").read_text())
    assert saved == run.summary
    assert list(saved) == ["checkpoint", "metrics", "known_before", "export_check", "after", "extra"]
    assert saved["after"] == {"before": {"held_out": 2}}  # before_report's result reaches after_report
    assert saved["export_check"]["abs_diff"] == 0  # the saved fp32 weights, reloaded: the same forward
    assert saved["metrics"]["train_loss"] > 0 and "eval_loss" in saved["metrics"]
    assert (out / "config.yaml").is_file() and Path(saved["extra"]).is_file()
    assert isinstance(run.final, torch.nn.Module) and run.trainer.state.global_step == 1


def _lora_layout(name: str) -> str:
    """A LoRA-wrapped base parameter's name as the plain model names it."""
    return name.replace(".base_layer", "")


def test_sft_with_lora_trains_only_the_lora_weights_and_exports_the_merged_model(tmp_path):
    job, cfg = _job(tmp_path, "peft=lora", "peft.r=4", "trainer.learning_rate=1e-2")
    run = finetune(job, cfg, SFT(job))
    live = dict(run.model.get_base_model().named_parameters())
    lora = {n: p for n, p in live.items() if "lora_" in n}
    frozen = {_lora_layout(n): p for n, p in live.items() if "lora_" not in n}
    base = dict(load_model(job.model)[0].named_parameters())  # the same seeded random init
    assert lora and frozen.keys() == base.keys()
    assert all(torch.equal(p, base[n]) for n, p in frozen.items())  # base weights bitwise unchanged
    assert not any(p.requires_grad for p in frozen.values())
    trained = [n for n, p in lora.items() if n.endswith("lora_B.default.weight") and p.abs().sum() > 0]
    assert trained  # lora_B starts at zero: it moved, so the LoRA weights trained (and are not merged live)
    check = run.summary["export_check"]  # the merged weights: other sums, within rounding
    assert check["abs_diff"] <= check["tolerance"]
    merged = AutoModelForCausalLM.from_pretrained(run.summary["checkpoint"])
    assert not any("lora" in n for n, _ in merged.named_parameters())
    ids = torch.tensor([[3, 40, 50, 60, 70]])
    with torch.no_grad():
        want = run.model.eval()(input_ids=ids).logits
        # merged == live LoRA model: W + BA against W x + B (A x), the rank-4 sums beside the forward's
        tol = model_tolerance(merged.config, 5, want, extra=4 * merged.config.num_hidden_layers)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, **tol)
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == run.summary


def test_the_export_check_allows_what_rounding_explains_in_the_live_dtype():
    """``export_tolerance``: fp32's ``n * u`` over the forward's sums; more for a bf16 live model and for a
    deeper one. ``compare_export`` passes a bf16 model against its fp32 export and refuses an export with a
    layer re-initialised (a partial save)."""
    import copy

    from transformers import LlamaConfig

    from recipes.common import compare_export, export_tolerance, forward_reduction
    from tests.helpers import lively_model

    model = lively_model("tiny-llama").hf
    config, ids = model.config, torch.randint(5, 261, (2, 24), generator=torch.Generator().manual_seed(0))
    fp32 = export_tolerance(torch.float32, config, ids.numel())
    assert fp32 == (forward_reduction(config, ids.numel()) + config.vocab_size + ids.numel()) * 2**-24
    bf16 = export_tolerance(torch.bfloat16, config, ids.numel())
    deep = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, vocab_size=32000)
    assert fp32 < bf16 < export_tolerance(torch.bfloat16, deep, ids.numel())
    assert fp32 < export_tolerance(torch.float32, deep, ids.numel())

    def loss(m) -> float:
        with torch.no_grad():
            return float(m(input_ids=ids, labels=ids).loss)

    exported = loss(model)
    live = loss(copy.deepcopy(model).to(torch.bfloat16))  # trained in bf16, exported in fp32
    assert compare_export(exported, live, bf16)["tolerance"] == bf16 * live
    partial = copy.deepcopy(model)
    with torch.no_grad():
        for weight in partial.model.layers[2].parameters():
            if weight.dim() == 2:  # a layer the export lost: a fresh init
                weight.normal_(0, 0.02)
    with pytest.raises(RuntimeError, match="exported checkpoint disagrees"):
        compare_export(loss(partial), exported, fp32)


def test_sft_checks_the_deepspeed_batch_before_loading(tmp_path, monkeypatch):
    import recipes

    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 999, "zero_optimization": {"stage": 2}}))
    _, cfg = _job(tmp_path, f"deepspeed.config_file={bad}")
    monkeypatch.setattr("recipes.finetune.load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match=r"train_batch_size=999 but micro batch"):
        recipes.run(cfg)


def test_the_closing_metrics_are_text_with_the_machine_beside_the_rates():
    from fastdecode.runtime.machine import machine_label
    from recipes.finetune import metrics_text

    metrics = {"train_runtime": 96.2, "train_samples_per_second": 0.665, "train_steps_per_second": 0.2}
    metrics |= {"total_flos": 1e12, "train_loss": 2.3123, "eval_loss": 2.45}
    assert metrics_text(metrics, "cpu") == (
        f"train_loss 2.312, eval_loss 2.45; train 96.2 s at 0.665 samples/s ({machine_label('cpu')})"
    )
