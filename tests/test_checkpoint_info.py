"""Self-describing checkpoints and the command-line papercuts of issue 13: ``checkpoint=`` alone fixes the family,
tokenizer, depth, label and output folder of every entry point; a contradicting model is refused before any work;
trainer fields need no ``+``; every model field overrides as documented; ``null`` switches LayerSkip parts off."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys

import pytest
from hydra import compose, initialize_config_dir

from fastdecode.config import CONFIG_DIR, ConfigError, ModelConfig, load_group, to_dataclass
from fastdecode.files.checkpoint_info import checkpoint_model, recommended_exit, write_sidecar
from fastdecode_cli.launch import check_command_line, checkpoint_is_model
from recipes.common import load_job
from tests.helpers import tiny_model


def _compose(config: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=config, overrides=list(overrides))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """tiny-llama exported as ``<run>/final`` with the sidecar a recipe writes (base model, exit, label)."""
    model, tokenizer = tiny_model("tiny-llama")
    out = tmp_path_factory.mktemp("run") / "layerskip-tiny-llama" / "final"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    base = dataclasses.asdict(load_group("model", "tiny-llama", ModelConfig))
    write_sidecar(out, recipe="layerskip", run_name="layerskip-tiny-llama", base_model=base, exit_layer=2)
    (out / "skipdecode.json").write_text(json.dumps({"skip": {"max_budget": 3, "min_budget": 2}}))
    return out


def test_checkpoint_alone_picks_the_checkpoint_model():
    assert checkpoint_is_model("speed", ["checkpoint=/x"]) == ["model=checkpoint"]
    assert checkpoint_is_model("speed", ["checkpoint=/x", "model=tiny-llama"]) == []
    assert checkpoint_is_model("speed", ["checkpoint=null"]) == []
    assert checkpoint_is_model("collect_jacobi", []) == []


def test_the_command_line_gets_model_checkpoint_before_hydras_flags(ckpt, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["speed.py", f"checkpoint={ckpt}", "--cfg", "job"])
    check_command_line("speed")
    assert sys.argv == ["speed.py", "model=checkpoint", f"checkpoint={ckpt}", "--cfg", "job"]


def test_speed_on_a_checkpoint_is_labelled_and_filed_as_it(ckpt):
    from fastdecode.bench.config import plan

    cfg = _compose(
        "speed",
        "model=checkpoint",
        f"checkpoint={ckpt}",
        "decoder=[autoregressive,self_speculative]",
        "hf_baseline=null",
    )
    assert cfg.output_dir == "outputs/speed/layerskip-tiny-llama"  # not outputs/speed/smollm2-135m
    job, methods, source = plan(cfg)
    assert job.model.name == "layerskip-tiny-llama" and job.model.family == "llama"
    assert job.model.tokenizer is None and job.model.name_or_path == str(ckpt)  # its own tokenizer
    assert methods[1].options["exit_layer"] == 2 and source == "checkpoint fastdecode.json"
    assert recommended_exit(ckpt) == (2, "checkpoint fastdecode.json")


@pytest.mark.parametrize(
    "file,key,value",
    [
        ("fastdecode.json", "exit_layer", "ab"),
        ("fastdecode.json", "exit_layer", 99),
        ("fastdecode.json", "exit_layer", -1),
        ("fastdecode.json", "exit_layer", 4),  # the last layer: nothing left to verify with
        ("generation_config.json", "assistant_early_exit", 0),
        ("generation_config.json", "assistant_early_exit", 2.5),
    ],
)
def test_a_recorded_exit_is_a_layer_of_the_checkpoint(ckpt, tmp_path, monkeypatch, file, key, value):
    """What the checkpoint records as its exit is checked against its config.json when it is read: the speed
    benchmark refuses it in its plan, before any model loads, naming the file and the range."""
    import shutil

    from fastdecode.bench.config import plan
    from fastdecode.files.checkpoint import CheckpointError

    final = tmp_path / "final"
    shutil.copytree(ckpt, final)
    if file == "fastdecode.json":
        write_sidecar(final, recipe="layerskip", run_name="layerskip-tiny-llama", exit_layer=value)
    else:
        write_sidecar(final, recipe="sft", run_name="sft-tiny-llama")
        (final / file).write_text(json.dumps({key: value}))
    message = rf"{final / file}: {key}={value!r} is not an exit layer .*4 layers.*\[1, 3\]"
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        recommended_exit(final)
    monkeypatch.setattr("fastdecode.runtime.loading.load_model", lambda *a: pytest.fail("loaded a model"))
    with pytest.raises(CheckpointError, match=rf"{key}={value!r} is not an exit layer"):
        plan(_compose("speed", "model=checkpoint", f"checkpoint={final}"))


@pytest.mark.parametrize(
    "model,why",
    [
        ("tiny-qwen2", r"family qwen2\) contradicts checkpoint .*model_type llama"),
        ("llama2-7b-quarter-random", r"\(16 layers\) contradicts checkpoint .*\(4 layers\)"),
    ],
)
def test_a_contradicting_model_is_refused_before_any_work(ckpt, model, why, monkeypatch):
    import fastdecode.runtime.loading

    monkeypatch.setattr(fastdecode.runtime.loading, "load_model", lambda *a: pytest.fail("loaded a model"))
    from fastdecode.bench.config import plan
    from fastdecode_cli.exits import run as exits_run

    with pytest.raises(ConfigError, match=f"model '{model}' .*{why}"):
        plan(_compose("speed", f"model={model}", f"checkpoint={ckpt}"))
    with pytest.raises(ConfigError, match=why):
        exits_run(_compose("exits", f"model={model}", f"checkpoint={ckpt}"))
    with pytest.raises(ConfigError, match=why):
        load_job(_compose("train", f"model={model}", f"checkpoint={ckpt}"))
    from eval.skipdecode_quality import run as quality_run

    with pytest.raises(ConfigError, match=why):
        quality_run(_compose("skipdecode_quality", f"model={model}", f"checkpoint={ckpt}"))


def test_exits_on_a_checkpoint_compares_the_base_it_records(ckpt):
    """The old IndexError: a SmolLM2 base report, then a 4-layer checkpoint's. Now the base is the recorded one,
    and a hand-chosen base of another depth is refused (above) before any report."""
    from fastdecode_cli.exits import ExitsJob, report_targets

    job = to_dataclass(ExitsJob, _compose("exits", "model=checkpoint", f"checkpoint={ckpt}"), "")
    targets = report_targets(job)
    assert targets["base"].name == "tiny-llama" and targets["checkpoint"].name == "layerskip-tiny-llama"
    assert (
        _compose("exits", "model=checkpoint", f"checkpoint={ckpt}").output_dir
        == "outputs/exits-layerskip-tiny-llama"
    )


def test_skipdecode_quality_decodes_with_the_checkpoints_own_policy(ckpt, tmp_path):
    from eval.skipdecode_quality import QualityJob
    from fastdecode.skipdecode import trained_policy_file

    cfg = _compose("skipdecode_quality", "model=checkpoint", f"checkpoint={ckpt}")
    assert cfg.output_dir == "outputs/skipdecode-quality-layerskip-tiny-llama"
    job = to_dataclass(QualityJob, cfg, "")
    assert trained_policy_file(job.checkpoint, job.skip_file) == str(ckpt / "skipdecode.json")
    assert trained_policy_file(job.checkpoint, None) is None  # null: the skip options
    assert trained_policy_file(str(tmp_path), job.skip_file) is None  # none to read


def test_training_from_a_checkpoint_is_named_after_it(ckpt):
    job = load_job(_compose("train", "model=checkpoint", f"checkpoint={ckpt}", "recipe=exit_adapter"))
    assert job.run_name == "exit_adapter-layerskip-tiny-llama" and job.model.family == "llama"


def test_bring_your_own_model_needs_no_family(ckpt):
    own = ModelConfig(name="mine", source="hub", name_or_path=str(ckpt))
    from fastdecode.runtime.loading import load_model, model_config

    assert model_config(own).model_type == "llama"
    model, _ = load_model(dataclasses.replace(own, device="cpu"))
    assert model.config.num_hidden_layers == 4
    with pytest.raises(ConfigError, match="family=qwen2 but the checkpoint is 'llama'"):
        model_config(dataclasses.replace(own, family="qwen2"))
    assert checkpoint_model(own, None) is own
    hub = to_dataclass(
        ModelConfig, _compose("speed", "model=hub", f"model.name_or_path={ckpt}").model, "model"
    )
    assert (
        hub.family is None and hub.name == "layerskip-tiny-llama" and model_config(hub).model_type == "llama"
    )


def test_trainer_fields_need_no_plus(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "model=tiny-llama", "trainer.gradient_checkpointing=true"])
    check_command_line("train")
    assert (
        "+trainer.gradient_checkpointing=true" in sys.argv
        and "trainer.gradient_checkpointing=true" not in sys.argv
    )
    job = load_job(_compose("train", *sys.argv[1:]))
    assert job.trainer["gradient_checkpointing"] is True
    monkeypatch.setattr(sys, "argv", ["train.py", "trainer.gradient_checkpointin=true"])
    with pytest.raises(ConfigError, match="Did you mean 'gradient_checkpointing'"):
        check_command_line("train")
    argv = ["train.py", "trainer.eval_steps=5"]
    monkeypatch.setattr(sys, "argv", list(argv))
    check_command_line("train", ["trainer.eval_steps=5"])  # an explicit command line: sys.argv left alone
    assert sys.argv == argv


DOCUMENTED = {
    "dtype": "bfloat16",
    "device": "cuda",
    "attn_implementation": "eager",
    "seed": 3,
    "recommended_exit": 2,
    "revision": "main",
    "tokenizer": "builtin-bytes",
    "family": "llama",
}


@pytest.mark.parametrize("field,value", sorted(DOCUMENTED.items()))
def test_every_model_field_overrides_without_plus(field, value):
    for config, model in (("train", "tiny-llama"), ("speed", "random-llama2-7b"), ("exits", "smollm2-135m")):
        cfg = _compose(config, f"model={model}", f"model.{field}={value}")
        assert getattr(to_dataclass(ModelConfig, cfg.model, "model"), field) == value


def test_every_model_yaml_declares_every_field():
    from omegaconf import OmegaConf

    from fastdecode.config import group_choices

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for name in group_choices("model"):
        declared = set(OmegaConf.load(CONFIG_DIR / "model" / f"{name}.yaml"))
        assert declared == fields, f"configs/model/{name}.yaml misses {sorted(fields - declared)}"


def test_null_switches_exit_losses_and_dropout_off():
    from layerskip_train.config import LayerSkipConfig

    cfg = _compose("train", "recipe.early_exit_loss=null", "recipe.layer_dropout=null")
    rcfg = to_dataclass(LayerSkipConfig, cfg.recipe, "recipe")
    assert rcfg.early_exit_loss.layers == [] and rcfg.layer_dropout.prob == 0.0
    from layerskip_train.module import EarlyExitLM

    lm = EarlyExitLM(tiny_model("tiny-llama")[0], rcfg, seed=0, total_steps=4)
    assert all(lm.exits_at(step) == [3] for step in range(4))  # only the model's own output
    lm.train()
    assert lm.drops_at(0, 0, 2) is None
    lm.eval()


def test_a_sparse_slice_that_leaves_steps_without_exit_loss_warns_once(caplog):
    from layerskip_train.config import LayerSkipConfig
    from layerskip_train.recipe import validate

    sparse = to_dataclass(LayerSkipConfig, {"early_exit_loss": {"layers": "1", "stride": 4}}, "recipe")
    with caplog.at_level(logging.WARNING, logger="layerskip_train.recipe"):
        validate(sparse, 4)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "3 of every 4 steps" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="layerskip_train.recipe"):
        validate(to_dataclass(LayerSkipConfig, {"early_exit_loss": {"stride": 2}}, "recipe"), 4)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("loss/exit_1, loss/exit_2, loss/exit_3, loss/exit_4" in r.getMessage() for r in caplog.records)
