"""Resume that never trains a different model: complete checkpoints only, and a finished run stays finished.

``checkpoint_problem`` says why a Trainer checkpoint is incomplete. ``resume_from_checkpoint=auto`` takes the
newest complete checkpoint and moves the incomplete ones aside, all before the model loads.
:class:`CompletionMarker` writes the manifest that marks a checkpoint complete, and :func:`train` stops a run
that already reached ``max_steps`` before its first step. The rules are in docs/design/recipes.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from fastdecode.config import ConfigError
from fastdecode.errors import disk_full_error, is_disk_full
from fastdecode.files.checkpoint import (
    manifest_problems,
    read_manifest,
    verify_requested,
    weight_problems,
    write_manifest,
)
from fastdecode.files.distributed import is_main_process, world_size
from fastdecode.files.faults import ENV as FAULT_ENV
from fastdecode.files.faults import fault_point
from fastdecode.files.io import apply_umask

log = logging.getLogger(__name__)

STATE = "trainer_state.json"
_STEP = re.compile(r"checkpoint-(\d+)")


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """N of a ``checkpoint-N`` folder, or None for any other name."""
    match = _STEP.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def _missing_training_files(path: Path) -> list[str]:
    """Without a manifest: the files a resume reads besides the weights (optimizer, scheduler, RNG)."""
    missing = []
    if not any(p.is_dir() and p.name.startswith("global_step") for p in path.iterdir()):  # else DeepSpeed's
        if not any((path / name).is_file() for name in ("optimizer.pt", "optimizer.bin")):
            missing.append("optimizer.pt")
        if not (path / "scheduler.pt").is_file():
            missing.append("scheduler.pt")
    world = world_size()
    rng = ["rng_state.pth"] if world == 1 else [f"rng_state_{r}.pth" for r in range(world)]
    return missing + [name for name in rng if not (path / name).is_file()]


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why the Trainer checkpoint ``path`` cannot be resumed from, or None when it is complete."""
    path = Path(path)
    try:
        state = json.loads((path / STATE).read_text())
    except FileNotFoundError:
        return f"no {STATE} (the Trainer writes it last: the save was cut short)"
    except (OSError, ValueError):
        return f"{STATE} is unreadable (cut short while being written)"
    step = checkpoint_step(path)
    if step is not None and state.get("global_step") != step:
        return f"{STATE} says global_step {state.get('global_step')}, the folder says {step}"
    if read_manifest(path) is not None:
        problems = manifest_problems(path, hashes=verify_requested())
    else:
        problems = [f"{name} is missing" for name in _missing_training_files(path)]
    problems += weight_problems(path)
    return "; ".join(problems) or None


def scan_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path, str | None]]:
    """Every ``checkpoint-N`` of ``output_dir``, newest first, with why it is incomplete (None: complete)."""
    root = Path(output_dir)
    found = (
        [(checkpoint_step(p), p) for p in root.glob("checkpoint-*") if p.is_dir()] if root.is_dir() else []
    )
    return [
        (n, p, checkpoint_problem(p)) for n, p in sorted((f for f in found if f[0] is not None), reverse=True)
    ]


def _set_aside(path: Path) -> None:
    """Rename an incomplete checkpoint out of the Trainer's way (its rotation would count it), keeping it."""
    target = path.with_name(f"incomplete-{path.name}")
    if target.exists():
        target = path.with_name(f"incomplete-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        os.replace(path, target)
        log.warning(
            "moved the incomplete %s aside to %s (delete it when you no longer need it)", path, target
        )
    except OSError as err:  # another rank moved it first, or a read-only folder: resuming is unaffected
        log.debug("could not move %s aside: %s", path, err)


def latest_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete checkpoint of ``output_dir`` (None: start from scratch); logs what was skipped."""
    found = scan_checkpoints(output_dir)
    chosen = next((p for _, p, problem in found if problem is None), None)
    for _, path, problem in found:
        if problem is not None:
            log.warning("resume: skipping %s, it is incomplete: %s", path, problem)
            if is_main_process():
                _set_aside(path)
    if chosen is not None:
        skipped = sum(problem is not None for _, _, problem in found)
        log.info("resume: from %s, the newest complete checkpoint (%d incomplete skipped)", chosen, skipped)
    elif found:
        log.warning("resume: no complete checkpoint in %s; training from the start", output_dir)
    return str(chosen) if chosen is not None else None


def resolve_resume(resume: str | None, output_dir: str | os.PathLike) -> str | None:
    """``auto`` -> the newest complete checkpoint (None on a fresh run); a PATH must be a complete one."""
    if resume in (None, "", "null"):
        return None
    if resume == "auto":
        return latest_complete_checkpoint(output_dir)
    if not Path(resume).is_dir():
        raise ConfigError(
            f"resume_from_checkpoint={resume} is not a directory; use auto or a checkpoint path."
        )
    problem = checkpoint_problem(resume)
    if problem is not None:
        raise ConfigError(
            f"resume_from_checkpoint={resume} is an incomplete checkpoint ({problem}); pick a complete one, or "
            "resume_from_checkpoint=auto (the newest complete checkpoint)."
        )
    return resume


def finished_at(checkpoint: str | None, max_steps: int) -> int | None:
    """The checkpoint's step when it already reached ``max_steps`` (> 0), else None."""
    if checkpoint is None or max_steps <= 0:
        return None
    step = json.loads((Path(checkpoint) / STATE).read_text()).get("global_step", 0)
    return step if step >= max_steps else None


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CompletionMarker(TrainerCallback):
    """Once the Trainer has written all of ``checkpoint-N`` (``on_save`` comes after its last file and the
    rotation), rank 0 writes the checkpoint's manifest: its presence vouches for the whole folder."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _barrier()  # every rank has written its part (its RNG state, its ZeRO shards) before rank 0 vouches
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            apply_umask(folder)  # safetensors writes 0600 files; the umask decides, as for every other output
            write_manifest(folder, global_step=state.global_step)


class _RunFinished(Exception):
    def __init__(self, step: int, max_steps: int) -> None:
        super().__init__(f"global_step {step} >= max_steps {max_steps}")
        self.step, self.max_steps = step, max_steps


class StopWhenFinished(TrainerCallback):
    """A run resumed at or past ``max_steps`` stops before its first step (transformers would train one)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            raise _RunFinished(state.global_step, state.max_steps)


class FaultInjection(TrainerCallback):
    """Test hook (``$FASTDECODE_FAULT``, see ``fastdecode.files.faults``): a kill at the end of step N."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        fault_point("step", state.global_step)


def _arm_faults(trainer: Any) -> None:
    """Only under ``$FASTDECODE_FAULT``: the step hook, and a kill inside ``checkpoint-N`` after its weights."""
    if not os.environ.get(FAULT_ENV):
        return
    trainer.add_callback(FaultInjection())
    save_rest = trainer._save_optimizer_and_scheduler  # called right after the weights are written

    def save_optimizer_and_scheduler(output_dir: str) -> None:
        fault_point("checkpoint", trainer.state.global_step)
        save_rest(output_dir)

    trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler


def train(trainer: Any, resume: str | None):
    """``trainer.train(resume_from_checkpoint=resume)`` with completion manifests in every checkpoint, and
    without training past ``max_steps``: a finished run returns at once, its weights loaded from ``resume``."""
    from transformers.trainer_utils import TrainOutput

    trainer.add_callback(CompletionMarker())
    trainer.add_callback(StopWhenFinished())
    _arm_faults(trainer)
    try:
        return trainer.train(resume_from_checkpoint=resume)
    except Exception as err:
        if is_disk_full(err):
            raise _checkpoint_disk_full(trainer) from err
        if not isinstance(err, _RunFinished):
            raise
        done = err
        log.info(
            "resume: %s is the end of the run (global_step %d, max_steps %d); nothing is trained again, "
            "only the steps after training (evaluation, export) are redone",
            resume,
            done.step,
            done.max_steps,
        )
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    mean = sum(losses) / len(losses) if losses else math.nan
    return TrainOutput(done.step, mean, {"train_steps_this_run": 0, "train_loss_logged_mean": mean})


def _checkpoint_disk_full(trainer: Any) -> Exception:
    """The disk filled up during training (a checkpoint, as a rule): the checkpoint being written is deleted
    when it is incomplete (it cannot be resumed from, and it holds the space a rerun needs); the error names
    it. The complete checkpoints before it are untouched: ``resume_from_checkpoint=auto`` continues there."""
    import shutil

    folder = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
    note = ""
    if folder.is_dir() and checkpoint_problem(folder) is not None:
        if is_main_process():
            shutil.rmtree(folder, ignore_errors=True)
        note = f" (the incomplete {folder.name} was deleted)"
    where = folder if note or folder.is_dir() else Path(trainer.args.output_dir)
    return disk_full_error(where, lower="trainer.save_total_limit", note=note)
