"""Every config composes and converts to typed dataclasses; bad keys and names fail with a useful message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException

from fastdecode.config import CONFIG_DIR, ConfigError, ModelConfig, group_choices, load_group, to_dataclass
from fastdecode_cli.launch import strip_launcher_args
from recipes.common import load_job, training_arguments

GROUPS = ["recipe", "model", "data", "trainer", "deepspeed", "experiment"]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def _all_options() -> list[tuple[str, str]]:
    return [(group, name) for group in GROUPS for name in group_choices(group)]


@pytest.mark.parametrize("group,name", _all_options(), ids=lambda x: str(x))
def test_every_config_composes_and_converts(group, name, tmp_path):
    overrides = [f"{group}={name}", f"output_dir={tmp_path}"]
    if group == "model" and name in ("checkpoint", "hub"):  # the directory or hub id is the user's to give
        with pytest.raises(ConfigError, match=r"set checkpoint=|needs model.name_or_path"):
            load_job(_compose(*overrides))
        return
    if group == "data" and name == "jsonl":
        overrides.append("data.path=some.jsonl")
    job = load_job(_compose(*overrides))
    assert job.output_dir == str(tmp_path)
    if group == "trainer":  # keys are exactly TrainingArguments fields: it must construct
        overrides_cpu = {"use_cpu": True, "bf16": False}
        args = training_arguments(job, **overrides_cpu)
        assert args.output_dir == str(tmp_path)
    if group == "deepspeed" and job.deepspeed.config_file:
        assert json.loads(job.deepspeed.path().read_text())["zero_optimization"]["stage"] in (2, 3)


def test_default_output_dir_is_deterministic():
    """No ${now:}: every rank of a multi-process launch resolves the same run directory."""
    first = load_job(_compose("model=tiny-llama")).output_dir
    second = load_job(_compose("model=tiny-llama")).output_dir
    assert first == second == "outputs/layerskip-tiny-llama"


def test_misspelt_key_names_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"Unknown key 'model\.nmae'\. Did you mean 'name'\?"):
        load_job(_compose("+model.nmae=x"))
    with pytest.raises(ConfigError, match=r"trainer\.learning_rat.*Did you mean 'learning_rate'"):
        load_job(_compose("+trainer.learning_rat=0.1"))
    with pytest.raises(ConfigError, match=r"trainer\.output_dir is set at the top level"):
        load_job(_compose("+trainer.output_dir=x"))
    with pytest.raises(ConfigError, match=r"model\.dtype"):
        load_job(_compose("model.dtype=float64"))


def test_wrong_value_type_is_named():
    with pytest.raises(ConfigError, match=r"data\.max_length: expected an integer"):
        load_job(_compose("data.max_length=long"))


def test_unknown_group_option_lists_choices():
    with pytest.raises(MissingConfigException) as err:
        _compose("model=nope")
    assert "smollm2-135m" in str(err.value) and "tiny-llama" in str(err.value)
    with pytest.raises(
        ConfigError, match=r"Unknown model 'tiny-lama'\. Did you mean 'tiny-llama'\?.*Choices:"
    ):
        load_group("model", "tiny-lama", ModelConfig)


def test_unknown_recipe_name_lists_choices():
    import recipes

    with pytest.raises(ConfigError, match=r"Unknown recipe 'nope'.*Choices: .*sft"):
        recipes.run(_compose("recipe.name=nope", "model=tiny-llama"))


def test_deepspeed_launcher_argument_is_stripped(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "unset")  # records the original state, so the test leaves no LOCAL_RANK
    monkeypatch.delenv("LOCAL_RANK")
    argv = ["train.py", "--local_rank=1", "model=tiny-llama"]
    assert strip_launcher_args(argv) == ["train.py", "model=tiny-llama"]
    import os

    assert os.environ["LOCAL_RANK"] == "1"
    assert strip_launcher_args(["x", "--local-rank", "0", "a=b"]) == ["x", "a=b"]


def test_model_configs_name_matches_file():
    for name in group_choices("model"):
        if name in ("checkpoint", "hub"):  # the directory (or hub id) is the user's to give
            assert load_group("model", name, ModelConfig, name_or_path="/x").name == name
            continue
        assert load_group("model", name, ModelConfig).name == name


def test_unknown_data_name_lists_choices():
    from fastdecode.data.config import DataConfig

    with pytest.raises(ConfigError, match=r"Unknown data 'sharegtp'\. Did you mean 'sharegpt'\?.*mt_bench"):
        load_group("data", "sharegtp", DataConfig)


@pytest.mark.parametrize("flag", ["--help", "--cfg job"])
def test_cli_help_and_cfg_job(flag):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "train.py", *flag.split(), "model=tiny-llama"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "tiny-llama" in out.stdout and "trainer:" in out.stdout


def test_device_and_dtype_resolution():
    import torch

    from fastdecode.runtime.loading import resolve_device, resolve_dtype

    cpu = resolve_device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32  # fp32 on a CPU
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    if not torch.cuda.is_available():
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            resolve_device("cuda")


@pytest.mark.parametrize("top", ["exits", "speed", "suffix_index"])
def test_other_entry_point_configs_compose(top):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name=top, overrides=["model=tiny-llama"])
    assert cfg.model.name == "tiny-llama"


def test_export_exit_config_composes_and_converts():
    from fastdecode_cli.export_exit import ExportExitJob

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="export_exit", overrides=["checkpoint=some/final", "exit_layer=8"])
    job = to_dataclass(ExportExitJob, cfg, "")
    assert (job.checkpoint, job.exit_layer, job.output_dir) == ("some/final", 8, None)


def test_a_drafter_s_option_group_converts_in_a_fresh_process():
    """A drafter's options (``decoder.<group>.*``) are registered by its package; the benchmark's checks and the
    API find them without any earlier import (a fresh interpreter, as ``eval/speed.py`` starts)."""
    import subprocess
    import sys

    code = (
        "from fastdecode.bench.config import MethodConfig, check_options\n"
        "from fastdecode.config import load_group, to_dataclass\n"
        "node = load_group('decoder', 'prompt_lookup_tree', dict)\n"
        "spec = to_dataclass(MethodConfig, node['prompt_lookup_tree'], 'decoder.prompt_lookup_tree')\n"
        "check_options('prompt_lookup_tree', spec, spec.options)\n"
        "print(sorted(spec.options['lookup']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tree" in out.stdout
