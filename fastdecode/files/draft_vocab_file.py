"""The draft vocabulary file format, shared by the data side (``data/draft_vocab.py`` builds the ids, the
recipes save them here) and the decoder side (``decoding/draft_vocab.py`` loads and checks;
``drafters/exits/adapter.py`` saves an adapter's own copy).

JSON ``{"vocab_size": V, "size": S, ..., "ids": [...]}``, ids most frequent first, written atomically.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from fastdecode.config import ConfigError
from fastdecode.files.io import atomic_write_json

DRAFT_VOCAB_FILE = "draft_vocab.json"


def save_draft_vocab(path: str | os.PathLike, ids: torch.Tensor, vocab_size: int, **meta: Any) -> Path:
    """Write ``ids [S]`` (built for a tokenizer of ``vocab_size`` ids) and any ``meta`` to ``path``."""
    ids_list = [int(i) for i in ids.tolist()]
    if len(set(ids_list)) != len(ids_list) or min(ids_list, default=0) < 0 or max(ids_list) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be distinct and in [0, {vocab_size})")
    return atomic_write_json(path, {"vocab_size": vocab_size, "size": len(ids_list), **meta, "ids": ids_list})


BUILD_HINT = "fastdecode.data.draft_vocab.draft_vocab_from_data and save_draft_vocab"


def load_draft_vocab(path: str | os.PathLike) -> tuple[torch.Tensor, int]:
    """``(ids [S] long, vocab_size it was built for)`` from a file written by ``save_draft_vocab``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"decoder.draft_vocab={str(path)!r}: no such file. Build one with {BUILD_HINT}, "
            "or set decoder.draft_vocab=null."
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ids, vocab_size = torch.tensor(data["ids"], dtype=torch.long), int(data["vocab_size"])
        if ids.dim() != 1:
            raise ValueError(f"ids is not a list of ids (shape {tuple(ids.shape)})")
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"decoder.draft_vocab={str(path)!r} is not a draft vocabulary file ({err}); rebuild it with "
            f"{BUILD_HINT}."
        ) from err
    wrong = ids[(ids < 0) | (ids >= vocab_size)]  # [n]: the ids outside the vocabulary
    if len(wrong) or ids.unique().numel() != len(ids):
        problem = (
            f"the id {int(wrong[0])}, outside" if len(wrong) else "an id twice; ids must be distinct and in"
        )
        raise ConfigError(
            f"decoder.draft_vocab={str(path)!r} holds {problem} the vocabulary of {vocab_size} ids it was built "
            f"for ([0, {vocab_size})); rebuild it with {BUILD_HINT}."
        )
    return ids, vocab_size
