"""Seeded random draws of a training step, as pure functions of their key.

Every random choice a method makes during training is a pure function of a key such as ``(seed, step,
micro_step, rank)``, never of the global RNG, so a resumed run draws what an uninterrupted one would.
``draw_generator``: a seeded ``torch.Generator`` for masks and subsets; ``row_uniforms``: one uniform per row
of an accumulated batch. Why two schemes: docs/design/training.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["draw_generator", "draw_seed", "row_uniforms"]


def draw_seed(stream: str, *key: int) -> int:
    """A 63-bit seed derived from ``(stream, *key)``; the same in every process and Python version."""
    text = "/".join([stream, *(str(k) for k in key)]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)


def draw_generator(stream: str, *key: int) -> torch.Generator:
    """A CPU generator seeded by ``draw_seed(stream, *key)``, e.g. ``("layer-dropout", seed, step, micro,
    rank)``."""
    return torch.Generator().manual_seed(draw_seed(stream, *key))


def row_uniforms(key: Sequence[int], rows: range) -> torch.Tensor:
    """``[len(rows)]`` float64 uniforms in [0, 1), one per row of an accumulated batch.

    Row ``r`` draws from numpy's ``SeedSequence([*key, r])`` (e.g. ``key = (seed, step, rank)``), so
    splitting the accumulated batch into micro-batches (which only changes which rows a call sees) changes no
    draw. One scalar per row needs no generator object.
    """
    return torch.tensor([np.random.default_rng([*key, r]).random() for r in rows], dtype=torch.float64)
