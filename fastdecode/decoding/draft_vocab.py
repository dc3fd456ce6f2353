"""Loading and checking a draft vocabulary for the drafter's head (the decoder side).

A draft vocabulary is a frequency-ranked subset of token ids that the drafter's LM head scores while
drafting; verification keeps the full head, so decoding stays lossless (``decoding/speculative.py``).
Building and saving one from training data is the data side: ``fastdecode/data/draft_vocab.py``. The two
sides share only the file format: JSON ``{"vocab_size": V, "ids": [...], ...}``, ids most frequent first.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fastdecode.config import ConfigError
from fastdecode.files.draft_vocab_file import load_draft_vocab
from fastdecode.files.file_cache import FileCache
from fastdecode.runtime.model import EarlyExitModel

_LOADED = FileCache(maxsize=8)  # per file version and device


def _load(path: Path, device: torch.device) -> tuple[torch.Tensor, int]:
    ids, vocab_size = load_draft_vocab(path)
    return ids.to(device), vocab_size


def draft_vocab_ids(path: str | os.PathLike | None, m: EarlyExitModel) -> torch.Tensor | None:
    """The draft vocabulary ``ids [S]`` in the file ``path`` (``DecodeConfig.draft_vocab``) on the device of
    ``m`` (the model whose head drafts), checked against its vocabulary; None when ``path`` is None.

    The tensor is loaded once per file version and device (``fastdecode/files/file_cache.py``) and the same object
    is returned every call, so the drafter's gathered head rows are reused (``EarlyExitModel.exit_logits_subset``).
    """
    if path is None:
        return None
    path = Path(path)
    if not path.is_file():
        load_draft_vocab(path)  # raises the ConfigError that says how to build one
    ids, vocab_size = _LOADED.get([path], lambda: _load(path, m.device), key=str(m.device))
    where = f"decoder.draft_vocab={str(path)!r}"  # its ids are in [0, vocab_size) (load_draft_vocab)
    if len(ids) == 0:
        raise ConfigError(f"{where} holds no token ids: rebuild it with this model's tokenizer.")
    # A tokenizer may be shorter than its model's (padded) embedding, never longer.
    if vocab_size > m.vocab_size:
        raise ConfigError(
            f"{where} was built for a vocabulary of {vocab_size} ids but the drafting model has "
            f"{m.vocab_size}: rebuild it with this model's tokenizer."
        )
    return ids
