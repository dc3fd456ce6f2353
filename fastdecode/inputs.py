"""What ``FastDecoder.generate`` accepts as its prompts, checked and turned into token-id lists.

A text, a list of texts, token ids (a ``[T]`` list or tensor), a batch of them (``[[...], ...]``, a ``[B, T]``
tensor) or a tokenizer batch (a mapping with ``input_ids`` and an optional ``attention_mask`` of the same
shape, left or right padded). Anything else is refused with a ``ConfigError`` naming what was given (a 3-D
tensor, float ids, a batch without ``input_ids``, a mask of another shape) before any decoding; the decoders'
own check (``decoding/common.py``) then judges the ids against the model (vocabulary, context).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastdecode.config import ConfigError

FORMS = (
    "a text, a list of texts, token ids ([T] list or tensor), a batch of token-id lists ([B, T] tensor) or a "
    "tokenizer batch (input_ids and attention_mask)"
)


def prompt_ids(inputs: Any, encode: Callable[[str], list[int]]) -> tuple[list[list[int]], bool]:
    """``(token-id prompts, one prompt given)`` of ``inputs``; ``encode`` turns a text into ids."""
    if isinstance(inputs, str):
        return [encode(inputs)], True
    if isinstance(inputs, dict) or hasattr(inputs, "keys"):  # a tokenizer's BatchEncoding
        return _tokenizer_batch(inputs), False
    if isinstance(inputs, torch.Tensor):
        return _tensor_rows(inputs, "inputs"), inputs.dim() == 1
    if isinstance(inputs, list) and inputs and all(isinstance(x, str) for x in inputs):
        return [encode(text) for text in inputs], False
    if isinstance(inputs, list) and inputs and not any(isinstance(x, (list, tuple)) for x in inputs):
        return [_id_row(inputs, "inputs")], True
    if isinstance(inputs, list) and inputs and all(isinstance(x, (list, tuple)) for x in inputs):
        return [_id_row(row, f"row {i} of inputs") for i, row in enumerate(inputs)], False
    raise ConfigError(f"generate(): inputs must be {FORMS}; got {_described(inputs)}.")


def _described(value: Any) -> str:
    if isinstance(value, list):
        return (
            "an empty list"
            if not value
            else f"a list of {', '.join(sorted({type(x).__name__ for x in value}))}"
        )
    return type(value).__name__


def _id_row(row: Any, what: str) -> list[int]:
    """A list of token ids (Python ints; not bools, floats or nested lists)."""
    wrong = next((x for x in row if not isinstance(x, int) or isinstance(x, bool)), None)
    if wrong is not None or not row:
        got = "nothing" if not row else f"{type(wrong).__name__} {wrong!r}"
        raise ConfigError(f"generate(): {what} must be token ids (ints); got {got}. Inputs may be {FORMS}.")
    return list(row)


def _tensor_rows(ids: torch.Tensor, what: str) -> list[list[int]]:
    """The rows of an id tensor ``[T]`` or ``[B, T]`` of an integer dtype."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ConfigError(
            f"generate(): {what} holds {ids.dtype} values; token ids are integers (torch.long): pass "
            "the tokenizer's ids, or convert whole numbers with .long()."
        )
    if ids.dim() not in (1, 2):
        raise ConfigError(
            f"generate(): {what} has shape {tuple(ids.shape)}; token ids are [T] (one prompt) or [B, T] "
            "(a batch)."
        )
    return ids.tolist() if ids.dim() == 2 else [ids.tolist()]


def _tokenizer_batch(batch: Any) -> list[list[int]]:
    """The rows of ``input_ids`` with the positions ``attention_mask`` drops (padding) removed."""
    if "input_ids" not in batch:
        raise ConfigError(
            f"generate(): a tokenizer batch needs input_ids; got the keys {sorted(map(str, batch.keys()))}."
        )
    ids = torch.as_tensor(batch["input_ids"])
    rows = _tensor_rows(ids, "input_ids")
    mask = batch.get("attention_mask")
    if mask is None:
        return rows
    mask = torch.as_tensor(mask)
    if mask.shape != ids.shape:
        raise ConfigError(
            f"generate(): attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(ids.shape)}; "
            "they must match (1 for a token, 0 for padding)."
        )
    keep = mask.reshape(len(rows), -1).bool().tolist()
    return [[t for t, k in zip(row, flags, strict=True) if k] for row, flags in zip(rows, keep, strict=True)]
