"""The disk space a training run will write, estimated and checked before the weights load.

The estimate counts the Trainer checkpoints that can be on disk at once (weights plus optimizer state)
and the fp32 export ``final/``. The parameter count comes from the model's ``config.json`` on the ``meta``
device. A run is refused only when even this estimate does not fit. What is counted, and why, is in
docs/design/recipes.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fastdecode.files.io import check_free_space
from recipes.common import TrainJob

LOWER = "trainer.save_total_limit or trainer.max_steps (fewer saves: trainer.save_steps), or peft=lora"


def parameter_count(config: Any) -> int:
    """Parameters of the model ``config`` describes (tied weights once), counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def weight_bytes(job: TrainJob) -> int:
    """Bytes per parameter of the model as it trains (``model.dtype``, ``auto`` resolved for its device)."""
    import torch

    from fastdecode.runtime.loading import resolve_device, resolve_dtype

    device = torch.device("cpu") if job.trainer.get("use_cpu") else resolve_device(job.model.device)
    return torch.empty((), dtype=resolve_dtype(job.model.dtype, device)).element_size()


def optimizer_bytes(job: TrainJob, per_weight: int) -> int:
    """Bytes of optimizer state per trained parameter in a checkpoint (docs/design/recipes.md)."""
    if job.trainer.get("save_only_model"):
        return 0
    if job.deepspeed.config_file is not None:
        return 12
    optim = str(job.trainer.get("optim", "adamw_torch"))
    return 2 * per_weight if "adam" in optim and "8bit" not in optim else 0


def planned_saves(trainer: dict[str, Any], after_step: int = 0) -> int:
    """Checkpoints the Trainer will write after step ``after_step`` (1 when unknown before the data is read)."""
    strategy = str(trainer.get("save_strategy", "steps"))
    max_steps, epochs = trainer.get("max_steps", -1), trainer.get("num_train_epochs", 3.0)
    if strategy == "no":
        return 0
    if strategy == "epoch" and max_steps <= 0:
        return math.ceil(epochs)  # a resume mid-run: an upper bound, the limit below keeps it honest
    if strategy != "steps" or max_steps <= 0:
        return 1
    every = trainer.get("save_steps", 500)
    every = math.ceil(max_steps * every) if every < 1 else int(every)
    steps = {s for s in range(every, max_steps + 1, every)} | {max_steps}
    return sum(s > after_step for s in steps)


def checkpoints_at_once(trainer: dict[str, Any], existing: int, new: int) -> int:
    """How many more checkpoints than ``existing`` will be on disk at the peak."""
    limit = trainer.get("save_total_limit")
    peak = existing + new if limit is None else min(existing + new, max(limit, 1) + 1)
    return max(peak - existing, 0)


def training_disk_need(job: TrainJob, params: int) -> tuple[int, str]:
    """``(bytes, what)``: what the run will write (docs/design/recipes.md) for a model of ``params`` parameters."""
    from recipes.resume import checkpoint_step, scan_checkpoints

    export = params * 4
    if job.peft.method != "none":
        return export, f"the export final/ ({params:,} parameters in fp32)"
    per_weight = weight_bytes(job)
    per_checkpoint = params * (per_weight + optimizer_bytes(job, per_weight))
    existing = [p for _, p, problem in scan_checkpoints(job.output_dir) if problem is None]
    resume = job.resume_from_checkpoint
    after = (checkpoint_step(resume) or 0) if resume else 0
    count = checkpoints_at_once(job.trainer, len(existing), planned_saves(job.trainer, after))
    what = (
        f"{count} checkpoint(s) at once of {params:,} parameters (weights + optimizer state, "
        f"{per_checkpoint // params} bytes per parameter) and the fp32 export final/"
    )
    return count * per_checkpoint + export, what


def check_training_disk(job: TrainJob, config: Any) -> None:
    """Refuse a run whose checkpoints and export will not fit on ``output_dir``'s disk (``DiskSpaceError``)."""
    needed, what = training_disk_need(job, parameter_count(config))
    check_free_space(Path(job.output_dir), needed, what, LOWER)
