"""The step sequence every fine-tuning recipe runs, written once; a recipe supplies only what is its own.

``finetune(job, cfg, recipe)`` calls the hooks of ``Recipe`` in this order: ``prepare``, ``validate``, load
the model, ``loaded``, ``datasets``, ``training_args``, ``before_report``, LoRA, ``module``,
``trainer_class``, train, ``export``, ``after_report``, ``extra_files``, ``describe``. The full sequence is
in docs/design/recipes.md. ``Recipe``'s defaults are plain supervised fine-tuning (``recipe=sft``); a new
method subclasses it and overrides what differs (usually ``module`` and ``trainer_class``, and its reports).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments, set_seed

from fastdecode.data.chat import build_datasets, collate
from fastdecode.files.checkpoint_info import write_sidecar
from fastdecode.files.distributed import is_main_process
from fastdecode.files.io import atomic_directory, atomic_write_json, save_resolved_config
from fastdecode.runtime.loading import load_model, model_config
from recipes.common import (
    TrainJob,
    apply_peft,
    check_deepspeed_batch,
    compare_export,
    export_checkpoint,
    export_tolerance,
    probe_loss,
    to_device,
    training_arguments,
)
from recipes.disk import check_training_disk
from recipes.resume import resolve_resume
from recipes.resume import train as train_or_finish
from recipes.speed import closing_text

log = logging.getLogger(__name__)

Collator = Callable[[list[dict]], dict[str, torch.Tensor]]


@dataclasses.dataclass(kw_only=True)
class FinetuneRun:
    """What ``finetune`` produced, handed to the after-training hooks and returned to the caller."""

    job: TrainJob
    out: Path  # the run directory (``job.output_dir``); the checkpoint is ``out / "final"``
    model: PreTrainedModel  # the live, trained HF model (a peft model with LoRA: LoRA weights not merged)
    tokenizer: Any
    train: Sequence[dict]  # what the Trainer trains on (examples, or a recipe's own map-style dataset)
    held_out: list[dict]
    args: TrainingArguments
    trainer: Trainer
    before: Any = None  # ``recipe.before_report``'s result (main process), else None
    final: PreTrainedModel | None = None  # the exported checkpoint as a model (rank 0), else None
    # where the after-training hooks write files that belong in ``final/``: the export's staging directory,
    # renamed onto ``out / "final"`` as a whole once every hook ran (fastdecode.files.io.atomic_directory)
    stage: Path | None = None
    summary: dict = dataclasses.field(default_factory=dict)


class Recipe:
    """A fine-tuning method as ``finetune`` sees it; every method has a working default (plain SFT).

    Hooks run in the order of the module docstring. State a hook computes for a later one (a policy, the
    report's examples) lives on the instance.
    """

    trainer_class: type[Trainer] = Trainer
    # the Trainer's checkpoints and the export hold the model (and its optimizer state): their size is
    # checked against the free disk space before the weights load (``recipes/disk.py``)
    checkpoints_the_model: bool = True

    def __init__(self, job: TrainJob) -> None:
        self.job = job

    def prepare(self) -> None:
        """Checks and loading that must happen before the weights load (they fail fast, or avoid a load)."""

    def validate(self, config: PretrainedConfig) -> None:
        """Check the recipe config against the model's HF config (read without its weights: a bad value
        fails before a 7B model loads)."""

    def loaded(self, model: PreTrainedModel, tokenizer: Any) -> None:
        """The model has just loaded, before any data work (a recipe that trains beside a frozen model
        freezes and fingerprints it here, and keeps it for work on it in ``datasets``)."""

    def datasets(self, tokenizer: Any) -> tuple[Sequence[dict], list[dict]]:
        """``(train, held_out)``: the Trainer's training set (examples, or any map-style dataset whose items
        the collator batches) and held-out examples, which feed the eval set and the reports."""
        return build_datasets(self.job.data, tokenizer)

    def eval_dataset(self, held_out: list[dict]) -> list[dict] | None:
        """The Trainer's eval set (None: no evaluation); its first rows also form the export probe."""
        return held_out or None

    def collator(self, tokenizer: Any, model: PreTrainedModel) -> Collator:
        """Batches of examples -> model inputs (``[B, T]`` tensors)."""
        return functools.partial(collate, pad_id=tokenizer.pad_token_id, mask_dtype=model.dtype)

    def training_args(self) -> dict[str, Any]:
        """``TrainingArguments`` fields the recipe sets itself (over the trainer group's)."""
        return {}

    def module(self, model: PreTrainedModel, args: TrainingArguments) -> nn.Module:
        """The module the Trainer trains around ``model`` (its forward returns ``{"loss": ...}``).

        Also rebuilt around the exported checkpoint to check it, so it must not depend on training state.
        """
        return model

    def trainer_kwargs(self, tokenizer: Any) -> dict[str, Any]:
        """Extra keyword arguments of ``trainer_class``."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Summary fields known before training (they follow ``checkpoint`` and ``metrics``)."""
        return {}

    def before_report(self, model: PreTrainedModel, tokenizer: Any, held_out: list[dict]) -> Any:
        """A measurement of the untrained model (main process only), passed on as ``run.before``."""
        return None

    def export(self, run: FinetuneRun) -> PreTrainedModel | None:
        """Save what was trained into ``run.stage`` (every rank calls it: ZeRO-3 gathers the partitions);
        returns, on rank 0, the model ``module`` is rebuilt around to check the export (None elsewhere).

        The default: the trained weights as a plain HF directory (LoRA merged), loaded back as a fresh model.
        """
        return export_checkpoint(run.trainer, run.model, run.tokenizer, self.job.peft, run.stage)

    def after_report(self, run: FinetuneRun) -> dict[str, Any]:
        """The measurement of the exported model (rank 0): summary fields."""
        return {}

    def extra_files(self, run: FinetuneRun) -> dict[str, Any]:
        """Files written next to the checkpoint (rank 0, after the report): summary fields."""
        return {}

    def describe(self, run: FinetuneRun) -> dict[str, Any]:
        """The recipe's fields of the checkpoint's ``fastdecode.json`` (e.g. LayerSkip's ``exit_layer``)."""
        return {}


def describe(job: TrainJob) -> dict[str, Any]:
    """What every exported checkpoint says about itself (``fastdecode.files.checkpoint_info``): the recipe, the
    run's label and the model it was trained from (so ``checkpoint=`` alone can name and compare it)."""
    return {
        "recipe": job.recipe["name"],
        "run_name": job.run_name,
        "base_model": dataclasses.asdict(job.model),
    }


def finetune(job: TrainJob, cfg: Any, recipe: Recipe) -> FinetuneRun:
    """Run the sequence of the module docstring; every rank calls it. ``cfg``: the composed config, saved
    next to the outputs (None: not saved)."""
    _before_loading(job, recipe)
    model, tokenizer = load_model(job.model)
    recipe.loaded(model, tokenizer)
    train, held_out = recipe.datasets(tokenizer)
    out = Path(job.output_dir)
    if cfg is not None:
        save_resolved_config(cfg, out)
    args = training_arguments(job, prediction_loss_only=True, **recipe.training_args())
    eval_set = recipe.eval_dataset(held_out)
    if is_main_process():
        print(plan_text(recipe, args, len(train), eval_set), flush=True)  # what follows, before it starts
    before = recipe.before_report(model, tokenizer, held_out) if is_main_process() else None
    model = apply_peft(model, job.peft, args.gradient_checkpointing)
    collator = recipe.collator(tokenizer, model)
    trainer = recipe.trainer_class(
        model=recipe.module(model, args),
        args=args,
        train_dataset=train,
        eval_dataset=eval_set,
        data_collator=collator,
        **recipe.trainer_kwargs(tokenizer),
    )
    resume = resolve_resume(job.resume_from_checkpoint, job.output_dir)
    result = train_or_finish(trainer, resume)  # a finished run is not trained one step more
    metrics = dict(result.metrics) | (trainer.evaluate() if eval_set else {})
    run = FinetuneRun(
        job=job,
        out=out,
        model=model,
        tokenizer=tokenizer,
        train=train,
        held_out=held_out,
        args=args,
        trainer=trainer,
        before=before,
    )
    run.summary = {"checkpoint": str(out / "final"), "metrics": metrics} | recipe.summary()
    probe_set = eval_set or train
    probe = collator([probe_set[i] for i in range(min(2, len(probe_set)))])
    live_loss = probe_loss(trainer, probe)  # every rank: ZeRO-3 gathers the partitions for this forward
    # final/ appears whole, with the recipe's files, or not at all (a kill during the export leaves the old one)
    with atomic_directory(out / "final", main_process=is_main_process(), fault="export") as stage:
        run.stage = stage
        run.final = recipe.export(run)
        if run.final is not None:  # rank 0
            run.summary["export_check"] = _check_export(recipe, run, probe, live_loss)
            run.summary |= recipe.after_report(run)
            run.summary |= recipe.extra_files(run)
            write_sidecar(stage, **describe(job) | recipe.describe(run))
    run.stage = out / "final"
    if run.final is not None:
        _conclude(run, metrics)
    return run


def _conclude(run: FinetuneRun, metrics: dict[str, Any]) -> None:
    """Rank 0, once final/ is whole: the summary on disk, the one-line log of the run, then the closing text
    (what auto decodes the checkpoint with, and how fast) as the run's last lines."""
    atomic_write_json(run.out / "summary.json", run.summary)
    log.info(
        "%s: checkpoint %s; %s",
        run.job.recipe["name"],
        run.out / "final",
        metrics_text(metrics, run.args.device),
    )
    closing = closing_text(run.summary)
    if closing:
        print(closing, flush=True)


def metrics_text(metrics: dict[str, Any], device: Any = None) -> str:
    """The Trainer's metrics as text: the losses and other values, then each phase's time and rate with the
    machine they were measured on (``device``: where it trained; ``"train_loss 2.31, eval_loss 2.45; train 96.2 s
    at 0.665 samples/s, ... (AMD EPYC, 1 thread)"``)."""
    from fastdecode.runtime.machine import machine_label

    rates = ("_runtime", "_samples_per_second", "_steps_per_second")
    values = [
        f"{name} {value:.4g}"
        for name, value in metrics.items()
        if isinstance(value, (int, float)) and not name.endswith(rates) and name != "total_flos"
    ]
    phases = [
        f"{name.removesuffix('_runtime')} {value:.1f} s at {metrics.get(name[:-8] + '_samples_per_second', 0):.3g} "
        "samples/s"
        for name, value in metrics.items()
        if name.endswith("_runtime") and isinstance(value, (int, float))
    ]
    timed = f"; {', '.join(phases)} ({machine_label(device)})" if phases else ""
    return ", ".join(values) + timed


def optimizer_steps(args: TrainingArguments, examples: int) -> tuple[int, str]:
    """``(steps, how)``: the optimizer steps the Trainer will take (``max_steps``, else epochs x batches)."""
    import math

    if args.max_steps > 0:
        return args.max_steps, f"trainer.max_steps={args.max_steps}"
    batches = math.ceil(examples / (args.per_device_train_batch_size * args.world_size))
    per_epoch = max(batches // args.gradient_accumulation_steps, 1)
    epochs = args.num_train_epochs
    return math.ceil(epochs * per_epoch), f"{epochs:g} epochs x {per_epoch} steps of {examples} examples"


def plan_text(recipe: Recipe, args: TrainingArguments, examples: int, eval_set: Any) -> str:
    """The short block a run prints before its work: the phases, the steps, the evaluation and reports."""
    steps, how = optimizer_steps(args, examples)
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    saves = {"no": "no checkpoints", "steps": f"a checkpoint every {args.save_steps:g} steps and at the end"}
    keep = f" (keeping {args.save_total_limit})" if args.save_total_limit and strategy != "no" else ""
    own = [
        getattr(type(recipe), name) is not getattr(Recipe, name) for name in ("before_report", "after_report")
    ]
    lines = [
        f"plan of {recipe.job.recipe['name']} on {recipe.job.model.name} into {args.output_dir}:",
        "  - report on the untrained model (the recipe's before-training report)" if own[0] else "",
        f"  - train: {steps} optimizer steps ({how}), {batch} sequences per step; "
        f"{saves.get(strategy, f'checkpoints: save_strategy={strategy}')}{keep}",
        f"  - evaluate on {len(eval_set)} held-out examples" if eval_set else "  - no evaluation set",
        f"  - export {args.output_dir}/final and check it against the trained model",
        "  - report on the trained model (the recipe's after-training report)" if own[1] else "",
    ]
    return "\n".join(line for line in lines if line)


def _before_loading(job: TrainJob, recipe: Recipe) -> None:
    """Every check that needs no weights: DeepSpeed batch, the recipe's own, disk room (``disk.py``)."""
    check_deepspeed_batch(job)
    set_seed(job.seed)
    recipe.prepare()
    config = model_config(job.model)
    recipe.validate(config)
    if recipe.checkpoints_the_model:
        check_training_disk(job, config)


def _check_export(recipe: Recipe, run: FinetuneRun, probe: dict, live_loss: float) -> dict:
    """The exported checkpoint, inside the recipe's own module, must reproduce the live model's loss on the
    probe batch (catches partial ZeRO-3 saves and lost LoRA merges)."""
    module = recipe.module(run.final, run.args).eval()
    device = next(module.parameters()).device  # the default export is on the CPU, a recipe's may not be
    with torch.no_grad():
        saved = float(module(**to_device(probe, device))["loss"])
    # the probe's tokens: the size of its ids or positions
    ids = [v for v in probe.values() if torch.is_tensor(v) and v.dim() == 2 and not v.is_floating_point()]
    tokens = max((v.numel() for v in ids), default=0)
    return compare_export(saved, live_loss, export_tolerance(run.model.dtype, run.model.config, tokens))
