"""``recipe=cllm`` end to end on tiny-llama and a synthetic trajectory directory: export, LoRA, resume, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

import recipes
from cllm_train.records import MANIFEST, SCHEMA_VERSION, RecordError, tokenizer_fingerprint
from fastdecode.config import CONFIG_DIR, ConfigError
from fastdecode.runtime.tokenizer import byte_tokenizer
from tests.helpers import (
    declare_second_eos,
    free_port,
    random_examples,
    synthetic_records,
    tiny_model,
    write_chat_jsonl,
)

TINY_ID = "random:tiny-llama:0"  # records.model_identity of configs/model/tiny-llama.yaml


def write_trajectories(directory: Path, records: list[dict], tokenizer=None, model_id: str = TINY_ID) -> Path:
    """A trajectory directory as collect_jacobi.py writes it: JSONL shards of 8 records + manifest.json."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for start in range(0, max(len(records), 1), 8):
        chunk = records[start : start + 8]
        data = "".join(json.dumps(r) + "\n" for r in chunk).encode()
        name = f"shard-r0-{start // 8:05d}.jsonl"
        (directory / name).write_bytes(data)
        shards.append({"path": name, "records": len(chunk), "bytes": len(data)})
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "model": {"id": model_id},
        "tokenizer": tokenizer_fingerprint(tokenizer or byte_tokenizer()),
        "shards": shards,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return directory


def cllm_cfg(tmp_path: Path, *extra: str, records: list[dict] | None = None):
    traj = tmp_path / "traj"
    if not traj.exists():
        write_trajectories(traj, synthetic_records(8) if records is None else records)
    overrides = [
        "recipe=cllm",
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={write_chat_jsonl(tmp_path / 'chat.jsonl', 12)}",
        "data.held_out=4",
        f"recipe.trajectories={traj}",
        "recipe.report.prompts=2",
        "recipe.report.max_new_tokens=8",
        "trainer.max_steps=4",
        "trainer.save_steps=2",
        "trainer.logging_steps=1",
        "trainer.warmup_steps=0",
        "trainer.per_device_train_batch_size=2",
        f"output_dir={tmp_path / 'run'}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _history(run: Path, step: int) -> list[dict]:
    state = json.loads((run / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "loss" in h]


@pytest.mark.parametrize("variant", [("global", "labels"), ("both", "fixed_point")])
def test_cllm_recipe_trains_exports_and_measures(tmp_path, variant):
    loss, target = variant
    records = 16 if loss == "global" else 6
    overrides = [
        f"recipe.consistency_loss={loss}",
        f"recipe.ar_target={target}",
        f"recipe.max_records={records}",
    ]
    summary = recipes.run(cllm_cfg(tmp_path, *overrides, "trainer.max_steps=2"))
    assert summary["export_check"]["abs_diff"] == 0  # the saved fp32 weights, reloaded: the same forward
    assert summary["trajectories"]["records"] == records
    logs = _history(tmp_path / "run", 2)
    assert len(logs) == 2 and all(h["loss/consistency"] > 0 and h["loss/ar"] > 0 for h in logs)
    assert all(("loss/local" in h) == (loss == "both") for h in logs)
    for when in ("before", "after"):
        report = summary["report"][when]
        assert report["perplexity"] > 1 and report["jacobi_tokens"] == 2 * 8  # no EOS stop: 8 per prompt
        assert report["tokens_per_forward"] >= 1 and report["jacobi_block"] == 4
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["report"] == summary["report"]
    reloaded = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    assert torch.isfinite(reloaded(torch.tensor([[3, 40, 50]])).logits).all()


def test_the_jacobi_report_stops_at_a_second_eos_of_the_generation_config():
    """The before/after report decodes held-out prompts until every EOS id the model declares
    (``fastdecode.tokens.eos_ids``): with a second one in its generation config, each prompt stops after it
    (the tokenizer's EOS alone would decode all max_new_tokens=8)."""
    import copy

    from cllm_train.config import CLLMConfig, CLLMReportConfig
    from cllm_train.recipe import measure

    model, tokenizer = tiny_model("tiny-llama")
    model = copy.deepcopy(model)  # the shared tiny model stays as it is
    declare_second_eos(model, tokenizer)
    held_out = [ex | {"prompt": f"question {i}"} for i, ex in enumerate(random_examples(3))]
    report = CLLMReportConfig(prompts=3, max_new_tokens=8, held_out_examples=2)
    result = measure(model, tokenizer, held_out, CLLMConfig(trajectories="unused", report=report), block=4)
    assert result["jacobi_tokens"] == 3  # one token per prompt: the declared EOS


def test_trajectories_from_the_collector_train(tmp_path):
    """collect_jacobi.py's real output (fixed points of tiny-llama itself) is what the recipe reads."""
    from cllm_train import collect

    overrides = [
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={write_chat_jsonl(tmp_path / 'chat.jsonl', 12)}",
        "data.held_out=4",
        "block_size=4",
        "max_new_seq_len=12",
        "filters.max_repeat_run=null",  # a random tiny model repeats itself
        "filters.ngram_size=null",
        "progress=false",
        f"output_dir={tmp_path / 'traj'}",
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        manifest = collect.run(compose(config_name="collect_jacobi", overrides=overrides))
    summary = recipes.run(cllm_cfg(tmp_path, "trainer.max_steps=2", "recipe.report.enabled=false"))
    assert summary["trajectories"]["records"] == manifest["totals"]["records"] > 0
    logs = _history(tmp_path / "run", 2)
    assert all(h["loss/consistency"] > 0 and h["loss/ar"] > 0 for h in logs)


def test_resume_repeats_the_same_losses(tmp_path, monkeypatch):
    """N steps straight == N/2, crash, resume, N/2: same data order, same state draws, same losses."""
    extra = ("recipe.report.enabled=false", "trainer.gradient_accumulation_steps=2")
    straight = tmp_path / "straight"
    recipes.run(cllm_cfg(straight, *extra))
    expected = [(round(h["loss"], 5), h["loss/consistency"]) for h in _history(straight / "run", 4)]

    from cllm_train.trainer import CLLMTrainer

    crashed = tmp_path / "crashed"
    original = CLLMTrainer.training_step

    def crash_after_checkpoint(self, *args, **kwargs):
        if self.state.global_step == 2:  # checkpoint-2 is saved: die like a killed job
            raise KeyboardInterrupt("simulated kill")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CLLMTrainer, "training_step", crash_after_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        recipes.run(cllm_cfg(crashed, *extra))
    monkeypatch.setattr(CLLMTrainer, "training_step", original)
    recipes.run(cllm_cfg(crashed, *extra, "resume_from_checkpoint=auto"))
    resumed = [(round(h["loss"], 5), h["loss/consistency"]) for h in _history(crashed / "run", 4)]
    assert resumed == expected


@pytest.mark.parametrize("ar_weight", [0.0, 10.0])
def test_gradient_accumulation_trains_like_one_large_batch(tmp_path, ar_weight):
    """4 records x 1 micro-batch == 2 x 2: same draws per row, every loss normalised over the whole step
    (ar_weight=0: the consistency loss alone, normalised by the count the trainer takes from its draws)."""
    runs = {}
    for batch, accum in ((4, 1), (2, 2)):
        out = tmp_path / f"b{batch}"
        extra = [
            f"trainer.per_device_train_batch_size={batch}",
            f"trainer.gradient_accumulation_steps={accum}",
        ]
        extra += [f"recipe.ar_weight={ar_weight}", "trainer.max_steps=2", "recipe.report.enabled=false"]
        recipes.run(cllm_cfg(out, *extra))
        runs[batch] = [v for h in _history(out / "run", 2) for v in (h["loss"], h["grad_norm"])]
    assert runs[4] == pytest.approx(runs[2], rel=1e-4)  # step 2 also checks that step 1's update matched


def test_lora_adapters_train_merge_and_reload(tmp_path):
    summary = recipes.run(
        cllm_cfg(
            tmp_path,
            "peft=lora",
            "peft.r=4",
            "trainer.learning_rate=1e-2",
            "trainer.max_steps=2",
            "recipe.report.enabled=false",
        )
    )
    check = summary["export_check"]  # merged weights reproduce the live LoRA model, within rounding
    assert check["abs_diff"] <= check["tolerance"]
    merged = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    assert not any("lora" in name for name, _ in merged.named_parameters())
    from fastdecode.config import ModelConfig, load_group
    from fastdecode.runtime.loading import load_model

    base = dict(load_model(load_group("model", "tiny-llama", ModelConfig))[0].named_parameters())
    changed = [n for n, p in merged.named_parameters() if not torch.equal(p, base[n])]
    assert any("q_proj" in n for n in changed) and not any("embed" in n for n in changed)


def _no_model(monkeypatch):
    monkeypatch.setattr("recipes.finetune.load_model", lambda *a, **k: pytest.fail("model weights loaded"))


def test_a_malformed_record_names_its_file_and_line(tmp_path, monkeypatch):
    traj = write_trajectories(tmp_path / "traj", synthetic_records(8))
    shard = traj / "shard-r0-00000.jsonl"
    lines = shard.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["first_mismatch"][-1] = 0  # the fixed point cannot mismatch itself
    lines[2] = json.dumps(bad)
    shard.write_text("\n".join(lines) + "\n")
    manifest = json.loads((traj / MANIFEST).read_text())
    manifest["shards"][0]["bytes"] = shard.stat().st_size
    (traj / MANIFEST).write_text(json.dumps(manifest))
    _no_model(monkeypatch)
    with pytest.raises(
        RecordError, match=r"shard-r0-00000\.jsonl:3: malformed trajectory record: first_mismatch"
    ):
        recipes.run(cllm_cfg(tmp_path))


def test_trajectories_of_another_tokenizer_are_refused_before_loading(tmp_path, monkeypatch):
    traj = write_trajectories(tmp_path / "traj", synthetic_records(2))
    manifest = json.loads((traj / MANIFEST).read_text())
    manifest["tokenizer"] = {"name": "other-bpe", "vocab_size": 32000, "vocab_hash": "ab" * 32}
    (traj / MANIFEST).write_text(json.dumps(manifest))
    _no_model(monkeypatch)
    with pytest.raises(
        ConfigError, match=r"collected with tokenizer 'other-bpe' \(32000 tokens.*Collect them"
    ):
        recipes.run(cllm_cfg(tmp_path))


def test_an_empty_trajectory_directory_is_refused(tmp_path, monkeypatch):
    _no_model(monkeypatch)
    with pytest.raises(ConfigError, match=r"holds no record"):
        recipes.run(cllm_cfg(tmp_path, records=[]))


@pytest.mark.parametrize(
    "override,message",
    [
        ("recipe.trajectories=null", r"recipe\.trajectories is not set.*collect_jacobi\.py"),
        ("recipe.consistency_loss=glob", r"Unknown consistency loss 'glob'\. Did you mean 'global'"),
        ("recipe.ar_target=label", r"Unknown AR target 'label'\. Did you mean 'labels'"),
        ("recipe.label_smoothing=1.0", r"label_smoothing must be in \[0, 1\)"),
        ("recipe.max_length=4", r"max_length=4 cannot hold one prefix token and a block of n=4"),
        ("+recipe.ar_wieght=1", r"Unknown key 'recipe\.ar_wieght'\. Did you mean 'ar_weight'"),
    ],
)
def test_bad_recipe_config_fails_before_loading(tmp_path, monkeypatch, override, message):
    _no_model(monkeypatch)
    with pytest.raises(ConfigError, match=message):
        recipes.run(cllm_cfg(tmp_path, override))


def test_labels_are_required_for_the_labels_ar_target(tmp_path, monkeypatch):
    _no_model(monkeypatch)
    with pytest.raises(ConfigError, match=r"ar_target=labels but 16 of 16 records have labels=null"):
        recipes.run(cllm_cfg(tmp_path, records=synthetic_records(8, labels=False)))


@pytest.mark.distributed
def test_two_process_zero3_training_exports_a_loadable_checkpoint(tmp_path):
    """ZeRO-3 on two CPU processes: the teacher forward without gradient, the gathered consistency count and
    the export all work on partitioned parameters."""
    import os
    import subprocess
    import sys

    write_trajectories(tmp_path / "traj", synthetic_records(8))
    args = [
        "train.py",
        "recipe=cllm",
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={write_chat_jsonl(tmp_path / 'chat.jsonl', 12)}",
        "data.held_out=4",
        f"recipe.trajectories={tmp_path / 'traj'}",
        "recipe.report.enabled=false",
        "trainer.max_steps=2",
        "trainer.save_steps=2",
        "trainer.per_device_train_batch_size=2",
        "trainer.gradient_accumulation_steps=2",
        "deepspeed=zero3",
        f"output_dir={tmp_path / 'run'}",
    ]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [*launch, str(free_port()), *args], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check = json.loads((tmp_path / "run" / "summary.json").read_text())["export_check"]
    assert check["abs_diff"] <= check["tolerance"]  # the gathered partitions: another layout, within rounding
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert all(p.numel() > 0 for p in model.parameters())  # no empty ZeRO-3 partitions saved
    assert all(h["loss/consistency"] > 0 for h in _history(tmp_path / "run", 2))
