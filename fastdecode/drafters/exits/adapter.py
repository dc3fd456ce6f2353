"""Exit adapters (Kangaroo, Liu et al., 2024): a small trainable module at exit E of a frozen model drafts.

The drafter is layers ``< E``, the adapter, then the shared final norm and LM head (optionally over a draft
vocabulary); verification runs on the exit hidden states from before the adapter, so decoding is lossless.
This module owns ``ExitAdapter`` (its kinds are built by ``fastdecode/runtime/exit_blocks.py``), its files
(``save_adapter``, ``load_adapter``, ``resolve_adapter``), the base model identity it is checked against and
``adapter_for_decoding``. Every mismatch is a named ``AdapterError``, raised before any work. Design notes:
docs/design/drafters.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.files.draft_vocab_file import DRAFT_VOCAB_FILE, load_draft_vocab, save_draft_vocab
from fastdecode.files.file_cache import FileCache, file_identity
from fastdecode.files.io import atomic_path, atomic_write_json
from fastdecode.runtime.exit_blocks import KINDS
from fastdecode.runtime.identity import tokenizer_fingerprint, weights_fingerprint
from fastdecode.runtime.model import EarlyExitModel

INITS = ("last", "exit")
FORMAT = "fastdecode-exit-adapter"
VERSION = 1
META_FILE = "adapter.json"
WEIGHTS_FILE = "adapter.safetensors"
INDEX_FILE = "adapters.json"  # a training run's adapters (one per exit) and the chosen one
CHECKPOINT_DIR = "exit_adapter"  # an adapter saved inside a model directory


class AdapterError(ConfigError):
    """Base of the exit adapter's named errors."""


class ExitLayerError(AdapterError):
    """The exit layer E is outside ``[1, L-1]``, or not the one the adapter was trained at."""


class AdapterMismatchError(AdapterError):
    """An adapter or feature cache made for another model, tokenizer or hidden size."""


class DraftVocabMismatchError(AdapterError):
    """A draft vocabulary other than the one the adapter was trained with, or built for another vocabulary."""


def check_exit_layer(exit_layer: Any, num_layers: int, key: str = "exit_layer") -> int:
    """``exit_layer`` as an int in ``[1, num_layers - 1]`` (blocks run by the drafter), else ExitLayerError."""
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer < num_layers:
        raise ExitLayerError(
            f"{key}={exit_layer!r} but the model has {num_layers} layers: an exit adapter sits after block E "
            f"and layers >= E verify, so E must be an integer in [1, {num_layers - 1}]."
        )
    return exit_layer


# --------------------------------------------------------------------------------------------------------
# Identity of the base model
def base_identity(m: EarlyExitModel, tokenizer: Any = None, name: str | None = None) -> dict:
    """What an adapter or a feature cache depends on: the geometry, the weights' fingerprint, the tokenizer."""
    cfg = m.config
    return {
        "name": name or getattr(cfg, "_name_or_path", "") or cfg.model_type,
        "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "num_layers": m.num_layers,
        "vocab_size": m.vocab_size,
        "fingerprint": weights_fingerprint(m.hf),
        "tokenizer": None if tokenizer is None else tokenizer_fingerprint(tokenizer),
    }


def check_base(found: dict, m: EarlyExitModel, tokenizer: Any = None, where: str = "the adapter") -> None:
    """Refuse ``found`` (a stored ``base_identity``) for another model or tokenizer: AdapterMismatchError
    naming every differing field. Names and paths are not compared (the same weights may move)."""
    ours = base_identity(m, tokenizer)
    keys = ("model_type", "hidden_size", "num_layers", "vocab_size", "fingerprint")
    diffs = [(k, found.get(k), ours[k]) for k in keys if found.get(k) != ours[k]]
    theirs_tok, our_tok = found.get("tokenizer"), ours["tokenizer"]
    if theirs_tok and our_tok and theirs_tok.get("vocab_hash") != our_tok.get("vocab_hash"):
        diffs.append(("tokenizer.vocab_hash", theirs_tok.get("vocab_hash"), our_tok.get("vocab_hash")))
    if diffs:
        detail = "; ".join(f"{k}: {a!r} there, {b!r} here" for k, a, b in diffs)
        raise AdapterMismatchError(
            f"{where} was made for another model or tokenizer ({detail}; made for {found.get('name')!r}). "
            "Train it (or build the cache) for this model."
        )


# --------------------------------------------------------------------------------------------------------
# The module
def source_layer(init: str, exit_layer: int, num_layers: int) -> int:
    """The layer an adapter block is copied from: the last one (``last``) or layer E (``exit``)."""
    if init not in INITS:
        raise unknown_name_error("exit adapter init", init, list(INITS))
    return num_layers - 1 if init == "last" else exit_layer


class ExitAdapter(nn.Module):
    """The trainable module at exit ``exit_layer`` of ``m``; ``m`` itself is not a submodule (never saved).

    Args:
        m: the frozen model.
        exit_layer: E, blocks run before the adapter, in ``[1, L-1]``.
        kind: ``block`` (one decoder layer of the model's family) | ``attention`` (Kangaroo's: a layer's
            pre-attention norm and self-attention, with its residual, and a second norm).
        source: the layer it is copied from (``source_layer``); the adapter keeps that layer's sliding window.
    """

    def __init__(
        self,
        m: EarlyExitModel,
        exit_layer: int,
        kind: str = "block",
        source: int | None = None,
        zero_residual: bool = False,
    ):
        super().__init__()
        check_exit_layer(exit_layer, m.num_layers)
        if kind not in KINDS:
            raise unknown_name_error("exit adapter kind", kind, list(KINDS))
        source = m.num_layers - 1 if source is None else source
        if not 0 <= source < m.num_layers:
            raise ConfigError(f"exit adapter source layer {source} outside [0, {m.num_layers - 1}]")
        self.exit_layer, self.kind, self.source = exit_layer, kind, source
        self.slot = m.num_layers  # its cache layer
        self.window = m.layer_window(source)
        self.block = m.adapter_block(kind, source, self.slot, zero_residual).to(m.device)
        self.files: tuple | None = None  # identity of the files it was loaded from (``load_adapter``)

    def forward(
        self,
        m: EarlyExitModel,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache=None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Adapted residual stream ``[B, T, H]`` of exit hidden states ``hidden [B, T, H]``; with a cache the
        T positions take the next slots of cache layer ``slot`` (reserved by the caller, as for any layer)."""
        return m.run_block(
            self.block,
            hidden,
            position_ids,
            self.slot,
            self.window,
            attention_mask=attention_mask,
            cache=cache,
        )

    @staticmethod
    def logits(m: EarlyExitModel, adapted: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The drafter's head on the adapted stream: shared final norm + LM head (rows ``vocab`` only)."""
        return m.exit_logits(adapted) if vocab is None else m.exit_logits_subset(adapted, vocab)

    def spec(self) -> dict:
        return {
            "exit_layer": self.exit_layer,
            "kind": self.kind,
            "source": self.source,
            "window": self.window,
        }

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_adapter(
    m: EarlyExitModel, exit_layer: int, kind: str = "block", init: str = "last", zero_residual: bool = False
) -> ExitAdapter:
    """A fresh adapter at exit ``exit_layer`` (checked), copied from the layer ``init`` names; with
    ``zero_residual`` it starts as the identity (its residual-writing projections zeroed)."""
    check_exit_layer(exit_layer, m.num_layers)
    return ExitAdapter(m, exit_layer, kind, source_layer(init, exit_layer, m.num_layers), zero_residual)


# --------------------------------------------------------------------------------------------------------
# Saving and loading
def vocab_digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(json.dumps([int(i) for i in ids.tolist()]).encode()).hexdigest()


def save_adapter(
    adapter: ExitAdapter,
    directory: str | os.PathLike,
    m: EarlyExitModel,
    tokenizer: Any = None,
    vocab: torch.Tensor | None = None,
    *,
    meta: dict | None = None,
) -> Path:
    """Write ``adapter`` (weights, JSON, its draft vocabulary ``vocab [S]`` or None) atomically to ``directory``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    info = {"format": FORMAT, "version": VERSION, **adapter.spec()}
    info["base"] = base_identity(m, tokenizer)
    info["parameters"] = adapter.num_parameters()
    info["draft_vocab"] = None
    if vocab is not None:
        info["draft_vocab"] = {"file": DRAFT_VOCAB_FILE, "size": len(vocab), "sha256": vocab_digest(vocab)}
    info["training"] = meta or {}
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in adapter.state_dict().items()}
    with atomic_path(directory) as tmp:
        tmp.mkdir()
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        if vocab is not None:
            save_draft_vocab(tmp / DRAFT_VOCAB_FILE, vocab.cpu(), vocab_size=m.vocab_size)
        atomic_write_json(tmp / META_FILE, info)
    return directory


def resolve_adapter(path: str | os.PathLike) -> Path:
    """The adapter directory named by ``path``: an adapter directory, a training run's directory
    (``adapters.json`` names the chosen exit), or a model directory with an ``exit_adapter/`` inside."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return path
    if (path / INDEX_FILE).is_file():
        index = read_index(path)
        chosen = index.get("chosen")
        if chosen is None or str(chosen) not in index["adapters"]:
            raise AdapterError(
                f"{path / INDEX_FILE} names no chosen adapter among its adapters (chosen: {chosen}; none is "
                f"when no exit was expected to pay); pick one of {sorted(index['adapters'])} with "
                f"decoder.adapter={path}/E<exit>."
            )
        return resolve_adapter(path / index["adapters"][str(chosen)])
    if (path / CHECKPOINT_DIR / META_FILE).is_file():
        return path / CHECKPOINT_DIR
    raise AdapterError(
        f"decoder.adapter={str(path)!r}: no {META_FILE} there (nor {INDEX_FILE} or {CHECKPOINT_DIR}/). Train "
        "one with `python train.py recipe=exit_adapter`, or set decoder.adapter=null."
    )


def read_index(run: str | os.PathLike) -> dict:
    """A training run's ``adapters.json``: ``adapters`` (each exit -> its adapter folder) and ``chosen``."""
    path = Path(run) / INDEX_FILE
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
        adapters = index["adapters"]
        valid = isinstance(adapters, dict) and all(isinstance(name, str) for name in adapters.values())
    except (ValueError, KeyError, TypeError):  # not JSON, no "adapters", not an object
        valid = False
    if not valid:
        raise AdapterError(
            f"{path} is not a run's adapter index (a JSON object whose 'adapters' maps each exit to its "
            "folder): pass one adapter directory instead, or train again with `python train.py "
            "recipe=exit_adapter`."
        )
    return index


def read_meta(directory: str | os.PathLike) -> dict:
    """``adapter.json`` of an adapter directory (resolved as in ``resolve_adapter``)."""
    path = resolve_adapter(directory) / META_FILE
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise AdapterError(f"{path} is not an exit adapter ({meta.get('format')!r}).")
    return meta


def load_adapter(
    directory: str | os.PathLike, m: EarlyExitModel, tokenizer: Any = None
) -> tuple[ExitAdapter, dict, torch.Tensor | None]:
    """``(adapter, meta, draft vocabulary ids or None)``, checked against ``m`` (and ``tokenizer``) first."""
    from safetensors.torch import load_file

    directory = resolve_adapter(directory)
    meta = read_meta(directory)
    check_base(meta["base"], m, tokenizer, where=f"the adapter {directory}")
    check_exit_layer(meta["exit_layer"], m.num_layers, f"{directory}: exit_layer")
    adapter = ExitAdapter(m, meta["exit_layer"], meta["kind"], meta["source"])
    adapter.load_state_dict(load_file(str(directory / WEIGHTS_FILE)), strict=True)
    adapter.to(device=m.device, dtype=m.dtype).eval()
    adapter.files = file_identity([directory / META_FILE, directory / WEIGHTS_FILE])
    ids = None
    if meta.get("draft_vocab"):
        ids, vocab_size = load_draft_vocab(directory / meta["draft_vocab"]["file"])
        if vocab_size != m.vocab_size or vocab_digest(ids) != meta["draft_vocab"]["sha256"]:
            raise DraftVocabMismatchError(
                f"{directory / meta['draft_vocab']['file']} does not match the adapter (built for {vocab_size} "
                f"ids, the model has {m.vocab_size}; or its ids changed since training)."
            )
        ids = ids.to(m.device)
    return adapter, meta, ids


# Loaded adapters per model object (weakly: a model that goes away takes its adapters with it), one at a time
# (what decoding needs), loaded again when one of the adapter's files changes.
_LOADED = FileCache(maxsize=1)


def _cached_load(directory: Path, m: EarlyExitModel) -> tuple[ExitAdapter, dict, torch.Tensor | None]:
    files = [directory / META_FILE, directory / WEIGHTS_FILE]
    files += [directory / DRAFT_VOCAB_FILE] if (directory / DRAFT_VOCAB_FILE).is_file() else []
    return _LOADED.get(files, lambda: load_adapter(directory, m), key=(str(m.device), m.dtype), owner=m.hf)


def adapter_for_decoding(cfg: Any, m: EarlyExitModel) -> tuple[ExitAdapter | None, torch.Tensor | None]:
    """The adapter named by ``cfg.adapter`` (a ``DecodeConfig``) and the draft vocabulary the drafter uses.

    Without an adapter: ``(None, _draft_vocab_ids(cfg.draft_vocab, m))``. With one: its exit must equal
    ``cfg.exit_layer`` when that is set (ExitLayerError); the drafter scores the adapter's own draft
    vocabulary, and ``cfg.draft_vocab``, when set, must be that same vocabulary (DraftVocabMismatchError).
    Loaded once per model and version of the adapter's files (``fastdecode/files/file_cache.py``).
    """
    if cfg.adapter is None:
        return None, _draft_vocab_ids(cfg.draft_vocab, m)
    directory = resolve_adapter(cfg.adapter)
    adapter, meta, ids = _cached_load(directory, m)
    if cfg.exit_layer is not None and cfg.exit_layer != adapter.exit_layer:
        raise ExitLayerError(
            f"decoder.exit_layer={cfg.exit_layer} but the adapter {directory} was trained at E="
            f"{adapter.exit_layer}; set decoder.exit_layer={adapter.exit_layer} (or null) or use another adapter."
        )
    if cfg.draft_vocab is not None:
        given = _draft_vocab_ids(cfg.draft_vocab, m)
        if ids is None or given.shape != ids.shape or not torch.equal(given, ids):
            trained = "the full LM head" if ids is None else f"a {len(ids)}-token draft vocabulary"
            raise DraftVocabMismatchError(
                f"decoder.draft_vocab={cfg.draft_vocab!r} ({len(given)} tokens) is not the draft vocabulary the "
                f"adapter {directory} was trained with ({trained}); set decoder.draft_vocab=null to use the "
                "adapter's own."
            )
    return adapter, ids


def _draft_vocab_ids(path, m):
    # Imported here: the decoders import this module, so a top-level import would be circular.
    from fastdecode.decoding.draft_vocab import draft_vocab_ids

    return draft_vocab_ids(path, m)
