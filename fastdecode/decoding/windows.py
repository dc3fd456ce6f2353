"""Sliding-window attention over a KV cache with holes.

``cache.attention_mask`` applies sliding windows in slot units, which equals position units only while a
row's slots are contiguous. Speculative rounds leave holes in rows that accepted fewer drafts than the
longest row, so the speculative decoders run windowed layers with masks built from the position of the
token in each slot instead. Layers without a window use the cache's own (exact) causal + validity mask.
"""

from __future__ import annotations

import torch

from fastdecode.cache import KVCache, attention_mask
from fastdecode.model import EarlyExitModel


class SlotPositions:
    """The position of the token in every cache slot, per row (``t [B, S]``; padding slots: 0)."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.t = positions  # [B, S]

    def write(self, start: int, positions: torch.Tensor) -> None:
        """Slots ``[start, start + T)`` now hold tokens at ``positions [B, T]`` (rollback = overwrite)."""
        self.t = torch.cat([self.t[:, :start], positions], 1)


def run_layers(
    m: EarlyExitModel,
    hidden: torch.Tensor,
    start: int,
    end: int,
    positions: torch.Tensor,
    cache: KVCache,
    slots: SlotPositions,
) -> torch.Tensor:
    """``m.run_layers`` over the cache for queries at the next slots of layer ``start`` (already reserved and
    recorded in ``slots``), with sliding windows measured in positions. ``hidden [B, T, H]``."""
    windows = m._windows[start:end]  # the adapter's per-layer sliding windows (None = full attention)
    if all(w is None for w in windows):
        return m.run_layers(hidden, start, end, positions, cache=cache)
    past, num_queries = cache.lengths[start], hidden.shape[1]
    key_valid = cache.key_valid[:, : past + num_queries]
    full = attention_mask(key_valid, past, num_queries, hidden.dtype)  # causal + validity: [B, 1, T, S]
    key_pos = slots.t[:, : past + num_queries]  # [B, S]
    layer = start
    while layer < end:
        group_end = layer + 1
        while group_end < end and windows[group_end - start] == windows[layer - start]:
            group_end += 1
        mask = full
        window = windows[layer - start]
        if window is not None:
            outside = positions[:, :, None] - key_pos[:, None, :] >= window  # [B, T, S]
            mask = full.masked_fill(outside[:, None], torch.finfo(hidden.dtype).min)
        hidden = m.run_layers(hidden, layer, group_end, positions, attention_mask=mask, cache=cache)
        layer = group_end
    return hidden
