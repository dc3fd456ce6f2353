"""What every training recipe shares: the typed job config, TrainingArguments, output and resume handling."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from fastdecode.config import CONFIG_DIR, ConfigError, ModelConfig, _suggest, to_dataclass
from fastdecode.data.config import DataConfig

log = logging.getLogger(__name__)

# Set from the top level of the job config, not from the trainer group.
JOB_LEVEL_ARGS = ("output_dir", "seed", "deepspeed", "resume_from_checkpoint", "run_name")


@dataclasses.dataclass
class DeepSpeedConfig:
    """``configs/deepspeed/<name>.yaml``: a DeepSpeed JSON (relative to configs/deepspeed/) or null."""

    config_file: str | None = None

    def path(self) -> Path | None:
        if self.config_file is None:
            return None
        path = Path(self.config_file)
        if not path.is_absolute() and not path.exists():
            path = CONFIG_DIR / "deepspeed" / path
        if not path.is_file():
            raise ConfigError(f"deepspeed.config_file '{self.config_file}' not found (looked at {path}).")
        return path


@dataclasses.dataclass
class TrainJob:
    """The composed ``configs/train.yaml``, typed. ``recipe`` is converted by the recipe itself."""

    recipe: dict
    model: ModelConfig
    data: DataConfig
    trainer: dict
    deepspeed: DeepSpeedConfig = dataclasses.field(default_factory=DeepSpeedConfig)
    seed: int = 0
    run_name: str = "run"
    output_dir: str = "outputs/run"
    resume_from_checkpoint: str | None = None
    experiment: dict | None = None  # an experiment config may leave notes here (name, budget, result)


def load_job(cfg: Any) -> TrainJob:
    """Convert the composed config into a ``TrainJob``; unknown or misspelt keys fail, naming the key."""
    job = to_dataclass(TrainJob, cfg, "")
    if "name" not in job.recipe:
        raise ConfigError("recipe.name is missing: pick a recipe with recipe=NAME.")
    check_trainer_keys(job.trainer)
    return job


def check_trainer_keys(trainer: dict) -> None:
    """Every key of the ``trainer`` group must be a ``transformers.TrainingArguments`` field name."""
    from transformers import TrainingArguments

    valid = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    for key in trainer:
        if key in JOB_LEVEL_ARGS:
            raise ConfigError(
                f"trainer.{key} is set at the top level of the config: use '{key}=...' instead."
            )
        if key not in valid:
            raise ConfigError(
                f"Unknown key 'trainer.{key}': not a transformers.TrainingArguments field.{_suggest(key, valid)}"
            )


def latest_checkpoint(output_dir: str | Path) -> str | None:
    """The newest ``checkpoint-N`` folder in ``output_dir`` (by N), or None."""
    ckpts = [p for p in Path(output_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    return str(max(ckpts, key=lambda p: int(p.name.split("-")[-1]))) if ckpts else None


def resolve_resume(job: TrainJob) -> str | None:
    """``auto`` -> latest checkpoint in output_dir (None on a fresh run); a PATH must exist."""
    resume = job.resume_from_checkpoint
    if resume in (None, "", "null"):
        return None
    if resume == "auto":
        return latest_checkpoint(job.output_dir)
    if not Path(resume).is_dir():
        raise ConfigError(
            f"resume_from_checkpoint={resume} is not a directory; use auto or a checkpoint path."
        )
    return resume


def training_arguments(job: TrainJob, **overrides: Any):
    """``transformers.TrainingArguments`` from the trainer group plus the job-level fields."""
    from transformers import TrainingArguments

    ds = job.deepspeed.path()
    kwargs = dict(job.trainer) | {
        "output_dir": job.output_dir,
        "seed": job.seed,
        "run_name": job.run_name,
        "deepspeed": str(ds) if ds else None,
    }
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)
