"""Building draft vocabularies (the data side): the token ids a drafter's LM head scores.

``draft_vocab_from_data`` ranks the trained-on tokens of a data config by frequency, special tokens first;
``save_draft_vocab`` (``fastdecode/files/draft_vocab_file.py``) writes the file next to the checkpoint.
Loading and checking it for decoding is the decoder side, ``fastdecode/decoding/draft_vocab.py``. Why a
smaller head pays, and how to use one: docs/design/data.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fastdecode.config import ConfigError
from fastdecode.data.chat import IGNORE_INDEX, build_datasets
from fastdecode.data.config import DataConfig


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


def draft_vocab_from_data(data_cfg: DataConfig, tokenizer: Any, size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens ``[S]`` of the *trained-on* tokens of ``data_cfg``; the held-out
    split is excluded. See ``draft_vocab_from_examples``."""
    train, _ = build_datasets(data_cfg, tokenizer)
    return draft_vocab_from_examples(train, tokenizer, size)


def draft_vocab_from_examples(examples: Iterable[dict], tokenizer: Any, size: int) -> torch.Tensor:
    """The ``size`` most frequent labelled tokens ``[S]`` of tokenized ``examples``
    (``input_ids``/``labels``): assistant replies when the data masks the rest (what a drafter drafts), every token otherwise. The
    tokenizer's special ids (EOS among them) are always included."""
    sequences = (
        [tok for tok, label in zip(ex["input_ids"], ex["labels"], strict=True) if label != IGNORE_INDEX]
        for ex in examples
    )
    special = [*getattr(tokenizer, "all_special_ids", []), getattr(tokenizer, "eos_token_id", None)]
    return build_draft_vocab(sequences, size, always=[i for i in special if i is not None])
