"""The fused features' per-channel scale, trained with and folded away at export.

A target's residual stream has a few outsized channels (SmolLM2-135M: RMS up to 425 at layer 28 against a
median of 15); ``fc`` reads them concatenated. ``feature_rms`` measures each input channel's RMS on the cache,
the training module divides the features by it, and ``fold_feature_scale`` divides ``fc``'s columns by it at
export (``fc(x / s) = (W / s) x``), so the saved drafter reads raw features as every engine feeds them. Why
and what it changes: docs/design/dflash.md.
"""

from __future__ import annotations

import torch

from fastdecode.drafters.dflash.layer import DFlashDraft

SCALES = ("rms", "none")
SAMPLE_RECORDS = 64  # cached records the RMS is measured on (the first ones: the same on every rank and run)


@torch.no_grad()
def feature_rms(reader, feature_ids: list[int], records: int = SAMPLE_RECORDS) -> torch.Tensor:
    """``[k * Ht]`` float32: each channel's RMS over the positions ``1 ..`` of the cache's first ``records``
    records, the layers ``feature_ids`` concatenated in that order (as ``collate_records`` does). Position 0
    (the attention sink's outliers) is left out; a channel that is zero throughout gets 1."""
    fields = [f"h{e}" for e in feature_ids]
    total, count = None, 0
    for i in range(min(records, len(reader))):
        record = reader.read(i, fields)
        x = torch.cat([record[f].float() for f in fields], dim=-1)[1:]
        squares = x.pow(2).sum(0)
        total = squares if total is None else total + squares
        count += x.shape[0]
    if total is None or count == 0:
        raise ValueError(f"the feature cache {getattr(reader, 'dir', '')} has no positions to measure")
    rms = (total / count).sqrt()
    return torch.where(rms > 0, rms, torch.ones_like(rms))


@torch.no_grad()
def fold_feature_scale(draft: DFlashDraft, scale: torch.Tensor) -> None:
    """``draft`` trained on ``features / scale`` -> the same function of the raw features: ``fc``'s input
    columns divided by ``scale`` ``[k * Ht]`` (in place)."""
    weight = draft.fc.weight
    if scale.shape != (weight.shape[1],):
        raise ValueError(f"a scale of {tuple(scale.shape)} for fc's {weight.shape[1]} input channels")
    weight.div_(scale.to(weight.device, torch.float32).to(weight.dtype)[None, :])
