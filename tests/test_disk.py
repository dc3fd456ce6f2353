"""A read-only output directory, too little disk space and a full disk (docs/RELIABILITY.md): named errors
before the work where it can be known, and resumable state when a write still fails.

Kill-free: the errors are injected through the fault points (``FASTDECODE_FAULT=enospc:NAME@N`` /
``erofs:writable``), and, where this machine lets the tests mount (root), met for real on a small tmpfs.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import recipes
from fastdecode.errors import DiskFullError, DiskSpaceError, OutputNotWritableError
from fastdecode.files.faults import ENV as FAULT
from fastdecode.files.io import atomic_directory, atomic_write_text, check_writable
from fastdecode.files.tensor_shards import ShardReader, ShardWriter
from recipes.resume import checkpoint_problem, latest_complete_checkpoint
from tests.job_configs import collect_cfg, train_cfg

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "1m", read_only: bool = False):
    """A tmpfs of ``size`` mounted on ``path`` (read-only: remounted so); skips when mounting is refused."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def sft_cfg(tmp_path: Path, *extra: str):
    return train_cfg(tmp_path, "sft", "data.held_out=2", *extra, rows=24)


def fail_on_load(monkeypatch) -> None:
    for target in ("recipes.finetune.load_model", "fastdecode.runtime.loading.load_model"):
        monkeypatch.setattr(target, lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr("cllm_train.collect.load_tokenizer", lambda *a, **k: pytest.fail("tokenizer loaded"))


def train_in_subprocess(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` (the console script) in ``cwd``."""
    cmd = [sys.executable, "-m", "fastdecode_cli.train", *args]
    environ = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=300)


# --------------------------------------------------------------------------------------- read-only output


def test_a_read_only_directory_is_named_with_the_fix(tmp_path):
    with tmpfs(tmp_path / "ro", read_only=True) as ro:
        with pytest.raises(OutputNotWritableError, match=rf"output_dir={ro} is not writable: Read-only file"):
            check_writable(ro)
        with pytest.raises(OutputNotWritableError, match=rf"it would be created in {ro}\).*output_dir=PATH"):
            check_writable(ro / "run" / "deeper")
    check_writable(tmp_path / "new" / "run")  # a writable parent: fine, and nothing is left behind
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".fastdecode-probe-*"))


def test_train_collect_and_speed_refuse_a_read_only_output_before_loading(tmp_path, monkeypatch):
    from cllm_train.collect import run as run_collect
    from eval.speed import run as run_speed
    from tests.job_configs import tiny_speed_cfg

    cfgs = [sft_cfg(tmp_path), collect_cfg(tmp_path), tiny_speed_cfg(tmp_path)]
    fail_on_load(monkeypatch)
    monkeypatch.setenv(FAULT, "erofs:writable")  # the probe file meets EROFS, as on a read-only mount
    for run, cfg in zip([recipes.run, run_collect, run_speed], cfgs, strict=True):
        with pytest.raises(
            OutputNotWritableError, match=r"output_dir=.* is not writable.*: Read-only file system"
        ):
            run(cfg)


def test_train_into_a_read_only_mount_says_so_in_one_line(tmp_path):
    data = tmp_path / "chat.jsonl"
    sft_cfg(tmp_path)  # writes the data file
    with tmpfs(tmp_path / "ro", read_only=True) as ro:
        args = ["model=tiny-llama", "recipe=sft", "data=jsonl", f"data.path={data}", f"output_dir={ro}/run"]
        out = train_in_subprocess(args, tmp_path)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"error: output_dir={ro}/run is not writable")


# ------------------------------------------------------------------------------------- room, before the work


def _written(run: Path) -> int:
    """Bytes of what the estimate counts: weights and optimizer state of every checkpoint, final's weights."""
    files = [*run.glob("checkpoint-*/model.safetensors"), *run.glob("checkpoint-*/optimizer.pt")]
    return sum(p.stat().st_size for p in [*files, run / "final" / "model.safetensors"])


def test_the_training_estimate_matches_what_a_run_writes_and_the_plan_is_said(tmp_path, capsys):
    from fastdecode.runtime.loading import model_config
    from recipes.common import load_job
    from recipes.disk import parameter_count, training_disk_need

    cfg = sft_cfg(tmp_path)
    job = load_job(cfg)
    needed, what = training_disk_need(job, parameter_count(model_config(job.model)))
    recipes.run(cfg)
    written = _written(tmp_path / "run")
    assert "2 checkpoint(s)" in what and abs(needed - written) < 0.05 * written, (needed, written)
    out = capsys.readouterr().out
    assert "plan of sft on tiny-llama" in out and "train: 4 optimizer steps (trainer.max_steps=4)" in out
    assert "a checkpoint every 2 steps and at the end" in out and "evaluate on 2 held-out examples" in out


def test_too_little_room_is_refused_before_loading_naming_the_numbers_and_the_option(tmp_path, monkeypatch):
    fail_on_load(monkeypatch)
    monkeypatch.setattr("fastdecode.files.io.free_bytes", lambda path: 1_000_000)
    with pytest.raises(DiskSpaceError) as refused:
        recipes.run(sft_cfg(tmp_path))
    message = str(refused.value)
    assert "2 checkpoint(s) at once" in message and "976.6 KiB (1000000 bytes) are free" in message
    assert "trainer.save_total_limit" in message
    monkeypatch.setattr("fastdecode.files.io.free_bytes", lambda path: 1_000_000_000)

    class Loads(Exception):
        pass

    def load_model(*args):
        raise Loads

    monkeypatch.setattr("recipes.finetune.load_model", load_model)
    with pytest.raises(Loads):  # with room, the run goes on to load the model
        recipes.run(sft_cfg(tmp_path))


def test_a_run_refused_for_room_on_a_small_disk_leaves_nothing_behind(tmp_path):
    """``python train.py output_dir=<a directory on a too-small disk>``: one line, and neither the run directory
    nor Hydra's ``.hydra/`` and ``train.log`` in it stay behind."""
    data = tmp_path / "chat.jsonl"
    sft_cfg(tmp_path)  # writes the data file
    with tmpfs(tmp_path / "small", size="256k") as small:
        args = [
            "model=tiny-llama",
            "recipe=sft",
            "data=jsonl",
            f"data.path={data}",
            f"output_dir={small}/run",
        ]
        out = train_in_subprocess(args, tmp_path)
        left = sorted(str(p.relative_to(small)) for p in small.rglob("*"))
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"error: not enough disk space in {small}/run")
    assert left == []


def test_the_feature_cache_estimate_is_its_size_and_too_little_room_is_refused(tmp_path, monkeypatch):
    from fastdecode.runtime.model import EarlyExitModel
    from fastdecode.training.feature_config import FeatureConfig
    from fastdecode.training.features import build_features, cache_bytes
    from tests.helpers import random_examples, tiny_model

    model, tokenizer = tiny_model("tiny-llama")
    m, examples = EarlyExitModel(model), random_examples(8)
    fcfg = FeatureConfig(batch_size=2, shard_records=4, top_k=4, dtype="float32")
    build_features(m, tokenizer, examples, tmp_path / "f", fcfg, exits=[1, 2], data="synthetic")
    size = sum(p.stat().st_size for p in (tmp_path / "f").glob("shard-*"))
    estimate = cache_bytes(examples, fcfg, 2, m.config.hidden_size)
    assert estimate <= size < estimate * 1.1  # the safetensors headers are the difference
    monkeypatch.setattr("fastdecode.files.io.free_bytes", lambda path: estimate // 2)
    with pytest.raises(
        DiskSpaceError, match=r"the feature cache needs about .*recipe\.features\.max_records"
    ):
        build_features(m, tokenizer, examples, tmp_path / "g", fcfg, exits=[1, 2], data="synthetic")


# ------------------------------------------------------------------------------------------- a full disk


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one_for_the_resume(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv(FAULT, "enospc:checkpoint@4")  # checkpoint-4's weights written, then ENOSPC
    with pytest.raises(DiskFullError, match=r"checkpoint-4 failed .*incomplete checkpoint-4 was deleted"):
        recipes.run(sft_cfg(tmp_path))
    assert checkpoint_problem(run / "checkpoint-2") is None and not (run / "checkpoint-4").exists()
    assert not (run / "final").exists()
    monkeypatch.delenv(FAULT)
    assert latest_complete_checkpoint(run) == str(run / "checkpoint-2")
    recipes.run(sft_cfg(tmp_path, "resume_from_checkpoint=auto"))
    assert (
        checkpoint_problem(run / "checkpoint-4") is None and (run / "final" / "model.safetensors").is_file()
    )


def test_a_really_full_disk_during_training_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr("recipes.finetune.check_training_disk", lambda *a: None)  # meet it for real
    sft_cfg(tmp_path)
    with tmpfs(tmp_path / "small", size="1m") as small:
        with pytest.raises(DiskFullError, match=r"the disk is full: writing .*small/run"):
            recipes.run(sft_cfg(tmp_path, f"output_dir={small}/run"))
        assert [p.name for p in (small / "run").glob("checkpoint-*")] == []  # the partial one is deleted


def _shard_records(directory: Path) -> list[dict]:
    return [ShardReader(directory)[i] for i in range(len(ShardReader(directory)))]


def test_a_full_disk_during_a_tensor_shard_keeps_the_manifest_and_resumes(tmp_path, monkeypatch):
    records = [{"x": torch.full((3,), float(i))} for i in range(6)]
    monkeypatch.setenv(FAULT, "enospc:shard@1")
    writer = ShardWriter(tmp_path, {"h": 1}, shard_records=2, lower="recipe.features.max_records")
    with pytest.raises(
        DiskFullError, match=r"shard-00001\.safetensors failed.*recipe\.features\.max_records"
    ):
        for record in records:
            writer.add(record)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["records"] == 2 and [s["path"] for s in manifest["shards"]] == ["shard-00000.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard-00000.safetensors"]
    monkeypatch.delenv(FAULT)
    writer = ShardWriter(tmp_path, {"h": 1}, shard_records=2)
    for record in records[writer.records :]:
        writer.add(record)
    writer.finish()
    assert [int(r["x"][0]) for r in _shard_records(tmp_path)] == list(range(6))


def test_a_really_full_disk_under_safetensors_and_atomic_writes_is_named(tmp_path):
    with tmpfs(tmp_path / "small", size="1m") as small:
        writer = ShardWriter(small / "cache", {"h": 1}, shard_records=1)
        writer.add({"x": torch.zeros(100_000)})  # 400 KB: fits
        with pytest.raises(DiskFullError, match=r"shard-00001\.safetensors failed \(no space left on device"):
            writer.add({"x": torch.zeros(300_000)})  # 1.2 MB: does not
        assert ShardReader(small / "cache").manifest["records"] == 1
        assert sorted(p.name for p in (small / "cache").iterdir()) == [
            "manifest.json",
            "shard-00000.safetensors",
        ]
        atomic_write_text(small / "a.txt", "first")
        with pytest.raises(DiskFullError, match=r"writing .*a\.txt failed"):
            atomic_write_text(small / "a.txt", "x" * 2_000_000)
        assert (small / "a.txt").read_text() == "first" and not list(small.glob(".a.txt.*"))


def test_a_full_disk_in_a_staged_directory_leaves_the_previous_version(tmp_path):
    dest = tmp_path / "final"
    with atomic_directory(dest) as stage:
        (stage / "a.txt").write_text("first")
    with pytest.raises(DiskFullError, match=rf"writing {dest} failed"), atomic_directory(dest) as stage:
        raise OSError(28, "No space left on device")
    assert (dest / "a.txt").read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["final"]


def test_a_full_disk_during_a_trajectory_batch_commits_nothing_of_it(tmp_path, monkeypatch):
    from cllm_train.collect import run
    from cllm_train.records import read_manifest

    monkeypatch.setenv(FAULT, "enospc:trajectory@0")
    with pytest.raises(DiskFullError, match=r"shard-r0-00000\.jsonl failed.*max_prompts"):
        run(collect_cfg(tmp_path, "max_prompts=6"))
    out = tmp_path / "out"
    assert read_manifest(out)["totals"]["prompts"] == 0 and (out / "shard-r0-00000.jsonl").stat().st_size == 0
    monkeypatch.delenv(FAULT)
    assert run(collect_cfg(tmp_path, "max_prompts=6"))["complete"]
