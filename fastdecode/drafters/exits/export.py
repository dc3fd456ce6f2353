"""An exit of a checkpoint as a draft model of its own: a plain Hugging Face directory of the first E layers.

``export_exit`` writes exit E of a LayerSkip checkpoint (its first E layers, then the shared final norm and
LM head) as a model of the same family with ``num_hidden_layers: E``, which drafts wherever a separate draft
model is accepted. It works on the config and the weights, never on a built model's modules, and refuses
what the user can get wrong before the weights load. Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from fastdecode.config import ConfigError, ModelConfig, checkpoint_label, load_group
from fastdecode.files.checkpoint import TOKENIZER_FILES, CheckpointError
from fastdecode.runtime.families import family_of

log = logging.getLogger(__name__)

# Per-layer lists of a config, one entry per decoder layer: cut to the exported layers.
PER_LAYER_KEYS = ("layer_types",)
# What a tokenizer is saved as, beside its vocabulary (``fastdecode.files.checkpoint.TOKENIZER_FILES``).
TOKENIZER_EXTRAS = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates",
)


def export_exit(
    checkpoint_dir: str | os.PathLike, exit_layer: int | None, out_dir: str | os.PathLike | None = None
) -> Path:
    """Write exit ``exit_layer`` of ``checkpoint_dir`` as a plain HF checkpoint in ``out_dir``; returns it.

    ``exit_layer``: E in [1, L - 1] (L: the checkpoint's layers); None: the exit the checkpoint records
    (``checkpoint_info.recommended_exit``). ``out_dir`` None: beside the checkpoint, ``<checkpoint>-exit<E>``.
    Everything the user can get wrong (the directory, its family, E, the output) is refused before the
    weights load, with a ``ConfigError`` naming the problem and the fix.
    """
    from fastdecode.files.checkpoint_info import write_sidecar
    from fastdecode.files.io import atomic_directory, check_writable

    source = Path(checkpoint_dir)
    config = source_config(source)
    exit_layer = resolve_exit(source, exit_layer, config.num_hidden_layers)
    out = Path(out_dir) if out_dir else source.with_name(f"{source.name}-exit{exit_layer}")
    check_output(out, source)
    check_writable(out)
    model = load_first_layers(source, config, exit_layer)
    with atomic_directory(out) as stage:
        model.save_pretrained(stage)
        copy_tokenizer(source, stage)
        write_sidecar(
            stage,
            run_name=f"{checkpoint_label(source)}-exit{exit_layer}",
            source_checkpoint=str(source.resolve()),
            source_exit_layer=exit_layer,
            source_num_hidden_layers=config.num_hidden_layers,
        )
    return out


def check_output(out: Path, source: Path) -> None:
    """The output replaces ``out`` as a whole: refuse the checkpoint itself and any directory that holds
    something other than an earlier export (a run folder, the checkpoint's parent), which it would delete."""
    from fastdecode.files.checkpoint_info import read_sidecar

    if out.resolve() == source.resolve():
        raise ConfigError(f"output_dir={out} is the checkpoint itself: choose another directory.")
    if out.is_dir() and any(out.iterdir()) and "source_exit_layer" not in read_sidecar(out):
        raise ConfigError(
            f"output_dir={out} exists and is not an exported exit: the export would replace it as a whole. "
            "Choose a new directory (or delete that one)."
        )


def source_config(source: Path) -> Any:
    """The checkpoint's HF config, after its files were checked (``check_checkpoint``: a missing directory,
    config, weights or tokenizer named) and its family found registered (``families.FAMILIES``)."""
    from fastdecode.files.checkpoint_info import CHECKPOINT_MODEL, checkpoint_model
    from fastdecode.runtime.loading import model_config

    model = load_group("model", CHECKPOINT_MODEL, ModelConfig, device="cpu", name_or_path=str(source))
    return model_config(checkpoint_model(model, str(source)))  # an unregistered family is refused here


def resolve_exit(source: Path, exit_layer: Any, layers: int) -> int:
    """E to export: ``exit_layer`` checked to be an int in [1, layers - 1], or the checkpoint's recorded one."""
    from fastdecode.files.checkpoint_info import recommended_exit

    if exit_layer is None:
        recorded, _ = recommended_exit(source)
        if recorded is None:
            raise ConfigError(
                f"{source} records no exit layer (no exit_layer in fastdecode.json, no "
                f"generation_config.assistant_early_exit): pass exit_layer=E with 1 <= E <= {layers - 1} "
                "(fastdecode-exits checkpoint=PATH recommends one)."
            )
        return recorded
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer < layers:
        raise ConfigError(
            f"exit_layer={exit_layer!r} is not an exit of {source} ({layers} layers): an exit is an int in "
            f"[1, {layers - 1}] (exit {layers} is the model itself). Pass one in that range, or "
            "exit_layer=null for the exit the checkpoint records."
        )
    return exit_layer


def exit_config(config: Any, exit_layer: int) -> Any:
    """A copy of ``config`` with ``num_hidden_layers = exit_layer`` and its per-layer lists cut to it."""
    import copy

    config = copy.deepcopy(config)
    for key in PER_LAYER_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, list | tuple) and len(value) == config.num_hidden_layers:
            setattr(config, key, list(value[:exit_layer]))
    config.num_hidden_layers = exit_layer
    return config


def load_first_layers(source: Path, config: Any, exit_layer: int) -> Any:
    """The checkpoint's model cut to its first ``exit_layer`` layers, on the CPU in the checkpoint's dtype:
    transformers loads the weights the cut config names; a weight it does not find raises a
    ``CheckpointError`` (the cut model would hold random weights); one left over that is not a dropped
    layer's (the family's layer prefix) is logged."""
    from transformers import AutoModelForCausalLM

    from fastdecode.runtime.loading import unreadable_checkpoint

    try:
        with quiet_load_report():
            model, info = AutoModelForCausalLM.from_pretrained(
                str(source), config=exit_config(config, exit_layer), dtype="auto", output_loading_info=True
            )
    except Exception as err:
        if not unreadable_checkpoint(err):
            raise
        raise CheckpointError(
            f"loading the weights of {source} failed ({type(err).__name__}: {err}); check the directory, or "
            "export the checkpoint again."
        ) from err
    missing = list(info["missing_keys"]) + [str(k) for k in info["mismatched_keys"]]
    if missing:
        raise CheckpointError(
            f"the first {exit_layer} layers of {source} do not load as a {config.model_type} model of "
            f"{exit_layer} layers: missing or mismatched {sorted(missing)}. The checkpoint's weights do not "
            "match its config.json: export it again."
        )
    family = family_of(config.model_type)
    dropped = re.compile(rf"^{re.escape(family.backbone)}\.{re.escape(family.layers)}\.(\d+)\.")
    other = sorted(k for k in info["unexpected_keys"] if not dropped.match(k))
    if other:  # outside the layers: the full model has the same modules, so it does not use them either
        log.warning(
            "%s: weights no module of a %s model uses, left out: %s", source, config.model_type, other
        )
    if getattr(model.generation_config, "assistant_early_exit", None) is not None:
        model.generation_config.assistant_early_exit = None  # an exit of the full model, not of this one
    return model.eval()


@contextlib.contextmanager
def quiet_load_report():
    """transformers' load report, silenced: it lists the dropped layers' weights as UNEXPECTED, "not ok if you
    expect identical arch"; ``load_first_layers`` checks what was left over itself and names any surprise.
    A filter on its logger, not a level: transformers reads that logger's level to decide other checks."""

    def keep(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()

    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def copy_tokenizer(source: Path, dest: Path) -> None:
    """The checkpoint's tokenizer files, copied as they are (nothing re-saved, nothing added)."""
    for name in (*TOKENIZER_FILES, *TOKENIZER_EXTRAS):
        path = source / name
        if path.is_dir():
            shutil.copytree(path, dest / name)
        elif path.is_file():
            shutil.copy2(path, dest / name)
