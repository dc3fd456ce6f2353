"""Draft vocabularies: a frequency-ranked subset of token ids that the drafter's LM head scores while drafting.

Why: on small models the LM head is a large share of a draft step (SmolLM2-135M: its 49,152 x 576 head costs
about as much as 8 of its 30 layers). Restricted to the few thousand tokens that carry most of the training
text, drafting gets cheaper; verification keeps the full head, so decoding stays lossless (a token outside
the subset is never drafted, only emitted by the verifier). See ``fastdecode/decoding/speculative.py``.

Build once from the training data, save next to the checkpoint, point the decoder at it::

    ids = draft_vocab_from_data(data_cfg, tokenizer, size=8192)
    save_draft_vocab(Path(checkpoint) / DRAFT_VOCAB_FILE, ids, vocab_size=len(tokenizer), source=data_cfg.name)
    generate(m, prompts, DecodeConfig(..., draft_vocab=str(Path(checkpoint) / DRAFT_VOCAB_FILE)))

The file is JSON (``{"vocab_size", "ids", ...}``, ids most frequent first), written atomically.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from fastdecode.config import ConfigError
from fastdecode.data.chat import IGNORE_INDEX, build_datasets
from fastdecode.io import atomic_write_json

DRAFT_VOCAB_FILE = "draft_vocab.json"


def build_draft_vocab(
    sequences: Iterable[Sequence[int]], size: int, always: Iterable[int] = ()
) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``sequences`` (each a sequence of ids) -> ``[S]`` long,
    ``S = min(size, ids seen + always)``: the ``always`` ids first (EOS and other special tokens, which a
    drafter must be able to propose however rare they are in the text), then by descending count, ties by id.
    """
    always = list(dict.fromkeys(int(i) for i in always))  # deduplicated, order kept
    if size < max(1, len(always)):
        raise ConfigError(
            f"draft vocabulary size={size} is smaller than the {len(always)} ids it must always hold "
            f"(special tokens); use size >= {max(1, len(always))}."
        )
    counts = torch.zeros(0, dtype=torch.long)
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.long).flatten()
        if ids.numel() == 0:
            continue
        if ids.min() < 0:
            raise ValueError(f"negative token id {int(ids.min())} in the data of a draft vocabulary")
        seen = torch.bincount(ids)
        if len(seen) > len(counts):
            counts = torch.nn.functional.pad(counts, (0, len(seen) - len(counts)))
        counts[: len(seen)] += seen
    if always:
        counts = torch.nn.functional.pad(counts, (0, max(0, max(always) + 1 - len(counts))))
        counts[always] = -1  # placed first below, never twice
    # Stable sort of ascending ids by descending count: equal counts stay in id order.
    order = torch.sort(counts, descending=True, stable=True).indices
    ranked = order[counts[order] > 0][: size - len(always)]
    return torch.cat([torch.tensor(always, dtype=torch.long), ranked])


def save_draft_vocab(path: str | os.PathLike, ids: torch.Tensor, vocab_size: int, **meta: Any) -> Path:
    """Write ``ids [S]`` (built for a tokenizer of ``vocab_size`` ids) and any ``meta`` to ``path``."""
    ids_list = [int(i) for i in ids.tolist()]
    if len(set(ids_list)) != len(ids_list) or min(ids_list, default=0) < 0 or max(ids_list) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be distinct and in [0, {vocab_size})")
    return atomic_write_json(path, {"vocab_size": vocab_size, "size": len(ids_list), **meta, "ids": ids_list})


def load_draft_vocab(path: str | os.PathLike) -> tuple[torch.Tensor, int]:
    """``(ids [S] long, vocab_size it was built for)`` from a file written by ``save_draft_vocab``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"decoder.draft_vocab={str(path)!r}: no such file. Build one with "
            "fastdecode.draft_vocab.draft_vocab_from_data and save_draft_vocab, or set decoder.draft_vocab=null."
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return torch.tensor(data["ids"], dtype=torch.long), int(data["vocab_size"])
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"decoder.draft_vocab={str(path)!r} is not a draft vocabulary file ({err}); rebuild it with "
            "fastdecode.draft_vocab.save_draft_vocab."
        ) from err


@functools.lru_cache(maxsize=8)
def _cached(path: str, mtime_ns: int, file_size: int, device: str) -> tuple[torch.Tensor, int]:
    ids, vocab_size = load_draft_vocab(path)
    return ids.to(device), vocab_size


def draft_vocab_ids(cfg: Any, m: Any) -> torch.Tensor | None:
    """The draft vocabulary named by ``cfg.draft_vocab`` (a ``DecodeConfig``) on the device of ``m`` (the
    model whose head drafts), checked against its vocabulary; None when no subset is configured.

    The tensor is loaded once per file version and device and the same object is returned every call, so the
    adapter's gathered head rows are reused (``EarlyExitModel.exit_logits_subset``).
    """
    if cfg.draft_vocab is None:
        return None
    path = Path(cfg.draft_vocab)
    if not path.is_file():
        load_draft_vocab(path)  # raises the ConfigError that says how to build one
    stat = path.stat()
    ids, vocab_size = _cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size, str(m.device))
    # A tokenizer may be shorter than its model's (padded) embedding, never longer.
    if vocab_size > m.vocab_size or (len(ids) and int(ids.max()) >= m.vocab_size) or len(ids) == 0:
        raise ConfigError(
            f"decoder.draft_vocab={str(path)!r} was built for a vocabulary of {vocab_size} ids "
            f"({len(ids)} of them kept) but the drafting model has {m.vocab_size}: rebuild it with this "
            "model's tokenizer."
        )
    return ids


def draft_vocab_from_data(data_cfg: Any, tokenizer: Any, size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens of the *trained-on* tokens of ``data_cfg`` (a ``DataConfig``); the
    held-out split is excluded. See ``draft_vocab_from_examples``."""
    train, _ = build_datasets(data_cfg, tokenizer)
    return draft_vocab_from_examples(train, tokenizer, size)


def draft_vocab_from_examples(examples: Iterable[dict], tokenizer: Any, size: int) -> torch.Tensor:
    """The ``size`` most frequent labelled tokens of tokenized ``examples`` (``input_ids``/``labels``):
    assistant replies when the data masks the rest (what a drafter drafts), every token otherwise. The
    tokenizer's special ids (EOS among them) are always included."""
    sequences = (
        [tok for tok, label in zip(ex["input_ids"], ex["labels"], strict=True) if label != IGNORE_INDEX]
        for ex in examples
    )
    special = [*getattr(tokenizer, "all_special_ids", []), getattr(tokenizer, "eos_token_id", None)]
    return build_draft_vocab(sequences, size, always=[i for i in special if i is not None])
