"""The ``trainer`` group, checked against ``transformers.TrainingArguments`` before anything loads: the one
place that validates it.

Every key must be a ``TrainingArguments`` field, except the job-level ones (``JOB_LEVEL_ARGS``). Every value
must fit its field's type hint and the ranges a run can train with. ``check_trainer`` does both, so a bad
value fails at once with the key's name. More in docs/design/recipes.md.
"""

from __future__ import annotations

import enum
import functools
import logging
import types
import typing
from typing import Any, Union

from fastdecode.config import ConfigError, convert_value, did_you_mean

log = logging.getLogger(__name__)

# Set from the top level of the job config, not from the trainer group.
JOB_LEVEL_ARGS = ("output_dir", "seed", "deepspeed", "resume_from_checkpoint", "run_name")
AT_LEAST_ONE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
NOT_NEGATIVE = (
    "learning_rate",
    "weight_decay",
    "warmup_steps",
    "dataloader_num_workers",
    "save_total_limit",
    "label_smoothing_factor",
    "eval_accumulation_steps",
)
POSITIVE = ("adam_epsilon", "logging_steps", "save_steps", "eval_steps")


@functools.cache
def training_fields() -> frozenset[str]:
    """The ``transformers.TrainingArguments`` fields a config may set (those its constructor takes)."""
    import dataclasses

    from transformers import TrainingArguments

    return frozenset(f.name for f in dataclasses.fields(TrainingArguments) if f.init)


def unknown_trainer_key(key: str) -> ConfigError:
    """The error for ``trainer.<key>`` that is not a ``TrainingArguments`` field, with the closest one."""
    return ConfigError(
        f"Unknown key 'trainer.{key}': not a transformers.TrainingArguments field."
        f"{did_you_mean(key, sorted(training_fields()))}"
    )


def check_trainer_keys(trainer: dict[str, Any]) -> None:
    """Every key of the ``trainer`` group must be a ``TrainingArguments`` field that the job does not set."""
    for key in trainer:
        if key in JOB_LEVEL_ARGS:
            raise ConfigError(
                f"trainer.{key} is set at the top level of the config: use '{key}=...' instead."
            )
        if key not in training_fields():
            raise unknown_trainer_key(key)


def check_trainer(trainer: dict[str, Any]) -> dict[str, Any]:
    """The ``trainer`` group checked (``check_trainer_keys``, then ``check_trainer_values``) and typed."""
    check_trainer_keys(trainer)
    return check_trainer_values(trainer)


@functools.cache
def _hints() -> dict[str, Any]:
    from transformers import TrainingArguments

    return typing.get_type_hints(TrainingArguments)


def _typed(key: str, value: Any, hint: Any) -> Any:
    """``value`` checked against ``hint``: enum members by their string values, everything else strictly."""
    where = f"trainer.{key}"
    args = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    if value is None and type(None) in args:
        return None
    enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
    if enums and isinstance(value, str):  # e.g. SchedulerType | str: HF only accepts the enum's values
        choices = [str(m.value) for e in enums for m in e]
        if value not in choices:
            raise ConfigError(
                f"{where}: '{value}' is not one of {', '.join(choices)}.{did_you_mean(value, choices)}"
            )
        return value
    plain = tuple(a for a in args if a is not type(None) and a not in enums)
    if not plain or any(a is Any or not _checkable(a) for a in plain):
        return value  # a type we cannot check from a config (objects): let TrainingArguments judge
    convert_value(value, Union[plain] if len(plain) > 1 else plain[0], where)  # noqa: UP007
    return value  # as given: an int stays an int (HF treats warmup_steps=2 and 2.0 alike, but why risk it)


def _checkable(tp: Any) -> bool:
    base = typing.get_origin(tp) or tp
    return base in (int, float, bool, str, list, tuple, dict) or base is typing.Literal


def _check_ranges(values: dict[str, Any]) -> None:
    """The ranges no run trains with; each error names the key and the allowed range."""
    for key in AT_LEAST_ONE:
        if key in values and values[key] < 1:
            raise ConfigError(f"trainer.{key}={values[key]}: must be >= 1.")
    for key in NOT_NEGATIVE:
        if values.get(key) is not None and values[key] < 0:
            raise ConfigError(f"trainer.{key}={values[key]}: must be >= 0.")
    for key in POSITIVE:
        if values.get(key) is not None and values[key] <= 0:
            raise ConfigError(f"trainer.{key}={values[key]}: must be > 0.")
    if values.get("max_steps", -1) <= 0 and values.get("num_train_epochs", 3.0) <= 0:
        raise ConfigError(
            f"trainer.max_steps={values.get('max_steps', -1)} means 'train for num_train_epochs', but "
            f"trainer.num_train_epochs={values['num_train_epochs']}: set max_steps > 0 or num_train_epochs > 0."
        )


def _check_fsdp(values: dict[str, Any]) -> None:
    """FSDP through the Trainer needs accelerators: accelerate builds its FSDP plugin for GPU-type distributed
    states only, so on CPUs the run would train with plain DDP, unsharded, without a word."""
    if not values.get("fsdp"):
        return
    import torch

    if values.get("use_cpu") or not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.fsdp={values['fsdp']!r} needs GPUs: on CPUs accelerate does not enable FSDP and the "
            "Trainer would silently train with DDP instead. Drop trainer.fsdp here, or shard with "
            "deepspeed=zero3 (which runs on CPU processes too)."
        )


def check_trainer_values(trainer: dict[str, Any]) -> dict[str, Any]:
    """Return the ``trainer`` group with every value checked against its TrainingArguments field; raise
    ConfigError naming the first bad key. Keys must already be TrainingArguments fields."""
    hints = _hints()
    values = {key: _typed(key, value, hints.get(key, Any)) for key, value in trainer.items()}
    _check_ranges(values)
    _check_fsdp(values)
    max_steps = values.get("max_steps", -1)
    if max_steps <= 0:  # Hugging Face reads this as "use epochs": say so, a typo like max_steps=0 is silent
        log.info(
            "trainer.max_steps=%s: Hugging Face reads max_steps <= 0 as 'train by epochs'; training "
            "trainer.num_train_epochs=%s epochs",
            max_steps,
            values.get("num_train_epochs", 3.0),
        )
    return values
