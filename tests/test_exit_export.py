"""Exits as draft models (fastdecode/drafters/exits/export.py): exit E exported as a plain HF checkpoint of E layers
gives exactly the exit's logits (every family), drafts for the full model in HF assisted generation with the
tokens of greedy decoding, and bad input is refused before the weights load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastdecode.config import CONFIG_DIR, ConfigError
from fastdecode.drafters.exits import export as exit_export
from fastdecode.drafters.exits.export import export_exit
from fastdecode.errors import OutputNotWritableError
from fastdecode.files.checkpoint import CheckpointError
from fastdecode.files.checkpoint_info import read_sidecar, write_sidecar
from fastdecode.files.faults import ENV as FAULT
from fastdecode_cli.export_exit import run as run_cli
from tests.conftest import TINY_MODELS
from tests.helpers import lively_model, model_tolerance, random_prompts, tiny_model

ROOT = Path(__file__).resolve().parents[1]
RECORDED = 2  # the exit every test checkpoint records in its fastdecode.json
UPPER = 0.1  # lively_model's scale of what layers >= 1 write: shallow exits agree with the output often


def source_model(name: str):
    """The tiny model of family ``name`` with lively weights (shared, never changed): the checkpoint's weights."""
    return lively_model(name, UPPER)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A saved checkpoint of every tiny family (weights, tokenizer, a sidecar recording exit 2), by name."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name in TINY_MODELS:
        path = root / name / "final"
        source_model(name).hf.save_pretrained(path)
        tiny_model(name)[1].save_pretrained(path)
        write_sidecar(path, recipe="layerskip", run_name=f"layerskip-{name}", exit_layer=RECORDED)
        out[name] = path
    return out


def load_draft(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
@pytest.mark.parametrize("exit_layer", [1, 3])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_the_exported_exit_has_the_exit_logits(name, exit_layer, checkpoints, tmp_path):
    """Its logits are EarlyExitModel's exit logits at E (fp32, 30 positions: past the 16-token windows)."""
    source = checkpoints[name]
    out = export_exit(source, exit_layer, tmp_path / "draft")
    draft, m = load_draft(out), source_model(name)
    assert draft.config.num_hidden_layers == exit_layer == len(draft.get_decoder().layers)
    for key in exit_export.PER_LAYER_KEYS:
        if getattr(m.config, key, None) is not None:
            assert getattr(draft.config, key) == list(getattr(m.config, key)[:exit_layer])
    ids = torch.randint(5, 261, (2, 30), generator=torch.Generator().manual_seed(exit_layer))
    pos = torch.arange(30).expand(2, -1)
    expected = m.exit_logits(m.run_layers(m.embed(ids, pos), 0, exit_layer, pos))
    # HF's layers against EarlyExitModel's (other kernels on some families)
    torch.testing.assert_close(draft(ids).logits, expected, **model_tolerance(m.config, 30, expected))
    tied = draft.get_output_embeddings().weight is draft.get_input_embeddings().weight
    assert tied == bool(m.config.tie_word_embeddings)
    sidecar = read_sidecar(out)
    assert sidecar["source_checkpoint"] == str(source.resolve())
    assert (sidecar["source_exit_layer"], sidecar["source_num_hidden_layers"]) == (exit_layer, m.num_layers)
    assert "exit_layer" not in sidecar  # an exit of this model would have to be < E
    text = "Draft with the first layers."
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == tiny_model(name)[1](text).input_ids


@torch.no_grad()
@pytest.mark.parametrize("name", TINY_MODELS)
def test_hf_assisted_generation_with_the_exit_equals_greedy(name, checkpoints, tmp_path):
    """``generate(assistant_model=exported)`` gives the tokens of plain greedy ``generate`` on 4 random
    prompts, and its drafts are accepted: the full model runs fewer forwards than it generates tokens."""
    out = export_exit(checkpoints[name], None, tmp_path / "draft")  # the recorded exit
    assert read_sidecar(out)["source_exit_layer"] == RECORDED
    target, draft = source_model(name).hf, load_draft(out)
    greedy_forwards = assisted_forwards = 0
    for prompt in random_prompts(4, seed=5):
        ids = torch.tensor([prompt])
        greedy, n = greedy_generate(target, ids)
        greedy_forwards += n
        assisted, n = greedy_generate(target, ids, assistant_model=draft)
        assisted_forwards += n
        assert torch.equal(assisted, greedy), prompt
    assert 0 < assisted_forwards < greedy_forwards


def greedy_generate(model, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, int]:
    """``(HF greedy generate's ids [1, T + new], the number of forwards of model it ran)``."""
    calls = []
    hook = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        return model.generate(ids, do_sample=False, max_new_tokens=24, **kwargs), len(calls)
    finally:
        hook.remove()


def test_bad_input_is_refused_before_the_weights_load(checkpoints, tmp_path, monkeypatch):
    source = checkpoints["tiny-llama"]
    monkeypatch.setattr(exit_export, "load_first_layers", lambda *a: pytest.fail("weights loaded"))
    out = tmp_path / "draft"
    for bad in (0, 4, -1, True, "2"):
        with pytest.raises(ConfigError, match=rf"exit_layer={bad!r} is not an exit .*\[1, 3\]"):
            export_exit(source, bad, out)
    with pytest.raises(CheckpointError, match="not a model directory"):
        export_exit(tmp_path / "nosuch", 2, out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        export_exit(tmp_path / "empty", 2, out)
    plain = tmp_path / "plain"
    shutil.copytree(source, plain)
    (plain / "fastdecode.json").unlink()
    with pytest.raises(ConfigError, match=r"records no exit layer.*exit_layer=E with 1 <= E <= 3"):
        export_exit(plain, None, out)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="Unknown model family 'gpt2'"):
        export_exit(plain, 2, out)
    assert not out.exists()


def test_a_weight_missing_from_the_checkpoint_is_named(checkpoints, tmp_path):
    """transformers would initialise a missing final norm at random and say so in a warning; the export
    refuses, naming it, and writes nothing."""
    from safetensors.torch import load_file, save_file

    source = tmp_path / "final"
    shutil.copytree(checkpoints["tiny-llama"], source)
    weights = load_file(source / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing or mismatched \['model.norm.weight'\]"):
        export_exit(source, 2, tmp_path / "draft")
    assert not (tmp_path / "draft").exists()


def test_a_weight_no_module_uses_is_logged_and_left_out(checkpoints, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    source = tmp_path / "final"
    shutil.copytree(checkpoints["tiny-llama"], source)
    weights = load_file(source / "model.safetensors") | {"model.extra.weight": torch.ones(2)}
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="fastdecode.drafters.exits.export"):
        out = export_exit(source, 2, tmp_path / "draft")
    assert "left out: ['model.extra.weight']" in caplog.text
    assert "model.layers.2" not in caplog.text  # the dropped layers are the export, not news
    assert "model.extra.weight" not in load_file(out / "model.safetensors")


def test_an_output_it_would_destroy_or_cannot_write_is_refused(checkpoints, tmp_path, monkeypatch):
    source = checkpoints["tiny-llama"]
    monkeypatch.setattr(exit_export, "load_first_layers", lambda *a: pytest.fail("weights loaded"))
    with pytest.raises(ConfigError, match="is the checkpoint itself"):
        export_exit(source, 2, source)
    with pytest.raises(ConfigError, match="exists and is not an exported exit"):
        export_exit(source, 2, source.parent)  # the run folder: replacing it would delete the checkpoint
    monkeypatch.setenv(FAULT, "erofs:writable")  # the probe file meets EROFS, as on a read-only mount
    with pytest.raises(OutputNotWritableError, match="is not writable"):
        export_exit(source, 2, tmp_path / "draft")


def test_the_cli_composes_and_writes_the_draft_beside_the_checkpoint(checkpoints, tmp_path):
    source = checkpoints["tiny-qwen2"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="export_exit", overrides=[f"checkpoint={source}"])
    out = run_cli(cfg)
    assert out == source.with_name(f"final-exit{RECORDED}")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == RECORDED
    again = export_exit(source, 1, out)  # an earlier export is replaced as a whole
    assert json.loads((again / "config.json").read_text())["num_hidden_layers"] == 1
    cmd = [sys.executable, "-m", "fastdecode_cli.export_exit", f"checkpoint={source}", "exit_layer=3"]
    cmd.append(f"output_dir={tmp_path / 'draft'}")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"draft model written: {tmp_path / 'draft'}" in done.stdout
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["num_hidden_layers"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["draft"]  # no Hydra run directory or log beside it
