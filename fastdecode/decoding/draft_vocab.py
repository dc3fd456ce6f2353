"""Loading and checking a draft vocabulary for the drafter's head (the decoder side).

A draft vocabulary is a frequency-ranked subset of token ids that the drafter's LM head scores while
drafting; verification keeps the full head, so decoding stays lossless (``decoding/speculative.py``).
Building and saving one from training data is the data side: ``fastdecode/data/draft_vocab.py``. The two
sides share only the file format: JSON ``{"vocab_size": V, "ids": [...], ...}``, ids most frequent first.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from fastdecode.config import ConfigError
from fastdecode.model import EarlyExitModel

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
        return torch.tensor(data["ids"], dtype=torch.long), int(data["vocab_size"])
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"decoder.draft_vocab={str(path)!r} is not a draft vocabulary file ({err}); rebuild it with "
            f"{BUILD_HINT}."
        ) from err


@functools.lru_cache(maxsize=8)
def _cached(path: str, mtime_ns: int, file_size: int, device: str) -> tuple[torch.Tensor, int]:
    ids, vocab_size = load_draft_vocab(path)
    return ids.to(device), vocab_size


def draft_vocab_ids(path: str | os.PathLike | None, m: EarlyExitModel) -> torch.Tensor | None:
    """The draft vocabulary ``ids [S]`` in the file ``path`` (``DecodeConfig.draft_vocab``) on the device of
    ``m`` (the model whose head drafts), checked against its vocabulary; None when ``path`` is None.

    The tensor is loaded once per file version and device and the same object is returned every call, so the
    adapter's gathered head rows are reused (``EarlyExitModel.exit_logits_subset``).
    """
    if path is None:
        return None
    path = Path(path)
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
