"""kill -9 at three moments of a LayerSkip run, then ``resume_from_checkpoint=auto``: per-step losses and final
weights identical to an uninterrupted run, and never a step past ``max_steps``.

Each run is ``python train.py ...`` in a subprocess; ``FASTDECODE_FAULT`` (``fastdecode/files/faults.py``) makes it
SIGKILL itself at the named point: between checkpoints, inside a checkpoint (weights written, optimizer, RNG
and trainer state not), during the export (``final/`` staged, not renamed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import write_chat_jsonl

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 6


def train(tmp_path: Path, out: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    data = tmp_path / "chat.jsonl"
    if not data.exists():
        write_chat_jsonl(data)
    args = [
        "recipe=layerskip",
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=4",
        f"trainer.max_steps={MAX_STEPS}",
        "trainer.save_steps=2",
        "trainer.logging_steps=1",
        "trainer.warmup_steps=0",
        "recipe.report.enabled=false",
        "recipe.layer_dropout.prob=0.5",  # the drops depend on the step: a wrong resume changes them
        f"output_dir={out}",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "FASTDECODE_FAULT"}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | ({"FASTDECODE_FAULT": fault} if fault else {})
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def step_losses(run: Path) -> list[tuple[int, float]]:
    state = json.loads((run / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    return [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    done = train(tmp, tmp / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    return {"losses": step_losses(tmp / "run"), "weights": final_weights(tmp / "run")}


def _left_by_the_kill(run: Path, fault: str) -> None:
    """What each kill really left behind (so the test kills where it says it does)."""
    if fault == "step@3":
        assert (run / "checkpoint-2").is_dir() and not (run / "checkpoint-4").exists()
    elif fault == "checkpoint@4":
        assert (run / "checkpoint-4" / "model.safetensors").is_file()
        assert not (run / "checkpoint-4" / "trainer_state.json").exists()
    else:
        assert (run / f"checkpoint-{MAX_STEPS}").is_dir() and not (run / "final").exists()
        assert list(run.glob(".final.*.tmp/out/model.safetensors"))  # the whole export, staged
    assert not (run / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["step@3", "checkpoint@4", "export"])
def test_kill_then_resume_gives_the_uninterrupted_run(tmp_path, reference, fault):
    run = tmp_path / "run"
    killed = train(tmp_path, run, fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    _left_by_the_kill(run, fault)
    resumed = train(tmp_path, run, "resume_from_checkpoint=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert step_losses(run) == reference["losses"]  # every step once, the same loss
    assert [s for s, _ in step_losses(run)] == list(range(1, MAX_STEPS + 1))
    assert not (run / f"checkpoint-{MAX_STEPS + 1}").exists()
    weights = final_weights(run)
    assert weights.keys() == reference["weights"].keys()
    assert all(torch.equal(weights[k], reference["weights"][k]) for k in weights)  # bit-identical
    assert not list(run.glob(".final.*"))
