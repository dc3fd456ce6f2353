"""What a checkpoint directory says about itself, read without loading any weights.

A trained ``final/`` is a plain Hugging Face directory plus ``fastdecode.json`` (``SIDECAR_FILE``): the
recipe, the run's name, the base model's config and, for LayerSkip, the recommended exit E.
``checkpoint_model`` turns ``checkpoint=PATH`` into the ``ModelConfig`` every entry point loads, and refuses a
model config chosen by hand that contradicts it. Why E stays out of ``generation_config.json``:
docs/design/files.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from fastdecode.config import SIDECAR_FILE, ConfigError, ModelConfig, checkpoint_label, to_dataclass
from fastdecode.files.checkpoint import CheckpointError, check_checkpoint
from fastdecode.files.io import atomic_write_json

SIDECAR_FORMAT = 1
CHECKPOINT_MODEL = "checkpoint"  # configs/model/checkpoint.yaml: "the model is the checkpoint itself"


def write_sidecar(directory: str | os.PathLike, **fields: Any) -> Path:
    """``fastdecode.json`` in ``directory`` (a checkpoint, or its export's staging directory)."""
    path = Path(directory) / SIDECAR_FILE
    atomic_write_json(path, {"format": SIDECAR_FORMAT} | fields)
    return path


def read_sidecar(directory: str | os.PathLike | None) -> dict:
    """The sidecar's fields; ``{}`` when there is none (a checkpoint from elsewhere)."""
    if not directory:
        return {}
    path = Path(directory) / SIDECAR_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ConfigError(f"{path} is not valid JSON ({err}); export the checkpoint again.") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}.")
    return data


def recommended_exit(directory: str | os.PathLike | None) -> tuple[int | None, str]:
    """E recorded with a checkpoint and where: the sidecar, else ``generation_config.assistant_early_exit``
    (checkpoints exported before the sidecar, or with ``recipe.export.hf_assistant_early_exit=true``); checked
    to be a layer of the checkpoint's config.json that leaves layers to verify with (``checked_exit``)."""
    exit_layer = read_sidecar(directory).get("exit_layer")
    if exit_layer is not None:
        return checked_exit(directory, exit_layer, SIDECAR_FILE, "exit_layer"), f"checkpoint {SIDECAR_FILE}"
    path = Path(directory) / "generation_config.json" if directory else None
    if path is not None and path.is_file():
        value = json.loads(path.read_text(encoding="utf-8")).get("assistant_early_exit")
        if value is not None:
            value = checked_exit(directory, value, path.name, "assistant_early_exit")
            return value, "checkpoint generation_config.assistant_early_exit"
    return None, "unset"


def checked_exit(directory: str | os.PathLike, value: Any, file: str, key: str) -> int:
    """``value`` of ``key`` in the checkpoint's ``file``, an exit E: an int in [1, L - 1] (L: config.json's
    ``num_hidden_layers``, when the directory has one), or a ``CheckpointError`` naming the file and the fix."""
    layers = (
        hf_config(directory).get("num_hidden_layers") if (Path(directory) / "config.json").is_file() else 0
    )
    layers = layers if isinstance(layers, int) else 0  # 0: unknown
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= 1
        and (not layers or value < layers)
    ):
        return value
    top, of = (layers - 1, f" (the model has {layers} layers)") if layers else ("num_hidden_layers - 1", "")
    raise CheckpointError(
        f"{Path(directory) / file}: {key}={value!r} is not an exit layer of this checkpoint{of}; an exit is an "
        f"int in [1, {top}]. Set it in that range (or remove it: no recorded exit), or export the checkpoint "
        "again."
    )


def hf_config(directory: str | os.PathLike) -> dict:
    """``config.json`` of a checkpoint directory as a mapping."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory} has no config.json: not a Hugging Face model directory.")
    return json.loads(path.read_text(encoding="utf-8"))


def _model_depth(model: ModelConfig) -> int | None:
    """The layer count a hand-chosen model config implies, when it is known without a download."""
    if model.source == "random" and model.random_init:
        return model.random_init.get("num_hidden_layers")
    if model.name_or_path and (Path(model.name_or_path) / "config.json").is_file():
        return hf_config(model.name_or_path).get("num_hidden_layers")
    return None


def check_agrees(
    model: ModelConfig, checkpoint: str | os.PathLike, depth_of_model: int | None = None
) -> None:
    """Refuse a model config that contradicts ``checkpoint``: another family or another depth (the model's
    depth from ``depth_of_model`` when the caller read it, else when it is known without a download)."""
    config = hf_config(checkpoint)
    model_type, depth = config.get("model_type"), config.get("num_hidden_layers")
    fix = "drop model= (the checkpoint describes itself) or pick the model it was trained from"
    if model.family is not None and model.family != model_type:
        raise ConfigError(
            f"model '{model.name}' (family {model.family}) contradicts checkpoint {checkpoint} "
            f"(model_type {model_type}): {fix}."
        )
    own_depth = _model_depth(model) if depth_of_model is None else depth_of_model
    if own_depth is not None and depth is not None and own_depth != depth:
        raise ConfigError(
            f"model '{model.name}' ({own_depth} layers) contradicts checkpoint {checkpoint} ({depth} layers): "
            f"{fix}."
        )


def checkpoint_model(model: ModelConfig, checkpoint: str | None) -> ModelConfig:
    """The model config that loads ``checkpoint`` (``model`` itself without one).

    ``model`` is ``configs/model/checkpoint.yaml`` (``checkpoint=`` alone: the entry points pick it) or a model
    chosen by hand, which must agree with the checkpoint; its placement (dtype, device, attention) is kept.
    The checkpoint's files are checked first (``check_checkpoint``), so a damaged one fails before any load.
    """
    if not checkpoint:
        return model
    check_checkpoint(checkpoint, what="checkpoint=")
    if model.name != CHECKPOINT_MODEL:
        check_agrees(model, checkpoint)
    return dataclasses.replace(
        model,
        name=checkpoint_label(checkpoint),
        family=hf_config(checkpoint).get("model_type"),
        source="hub",
        name_or_path=str(checkpoint),
        revision=None,
        pypi=None,
        random_init=None,
        tokenizer=None,  # the tokenizer saved with the checkpoint
    )


def base_model(checkpoint: str | None) -> ModelConfig | None:
    """The model a checkpoint was trained from, as recorded in its sidecar (None when not recorded)."""
    node = read_sidecar(checkpoint).get("base_model")
    return (
        None if node is None else to_dataclass(ModelConfig, node, f"{checkpoint}/{SIDECAR_FILE}: base_model")
    )
