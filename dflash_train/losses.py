"""The DFlash training loss (Chen et al., 2026, "DFlash: Block Diffusion for Flash Speculative Decoding"), as
pure functions of a batch: random anchors over response tokens (``anchor_positions``), each anchor's block
``[anchor token, MASK x (B - 1)]`` with its positions and same-position labels (``block_inputs``), the slot
weights ``exp(-(k - 1) / gamma)`` (``decay_weights``) and the weighted CE and/or KL (``dflash_loss``), which
returns ``(sum, weight_sum)``, not a mean. The batch fields and the alignment: docs/design/methods.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fastdecode.tokens import IGNORE_INDEX

KINDS = ("ce", "kl", "both")


def anchor_candidates(response: torch.Tensor) -> torch.Tensor:
    """``response [B, W]`` bool (position ``p`` holds a response token) -> bool ``[B, W]``: the positions
    ``p`` a block may start at, ``response[p] & response[p + 1]`` (its first draft is a response token)."""
    out = torch.zeros_like(response, dtype=torch.bool)
    out[:, :-1] = response[:, :-1].bool() & response[:, 1:].bool()
    return out


def anchor_positions(
    response: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``num_anchors`` random anchors per row among ``anchor_candidates(response)``, drawn without
    replacement from ``generator`` (CPU; one per row: a row's anchors then depend on its own generator alone,
    not on the batch it landed in), sorted. Returns ``(anchors [B, N], keep [B, N])`` (int64, bool) on
    ``response``'s device, ``N = max(1, min(num_anchors, most candidates of a row))``; a row with fewer
    candidates is padded with anchor 0 and ``keep`` False."""
    candidates = anchor_candidates(response).cpu()
    batch, counts = response.shape[0], candidates.sum(1)
    n = max(1, min(num_anchors, int(counts.max()) if batch else 0))
    gens = list(generator) if isinstance(generator, Sequence) else [generator] * batch
    if len(gens) != batch:
        raise ValueError(f"{len(gens)} generators for {batch} rows: give one per row, or one")
    anchors = torch.zeros(batch, n, dtype=torch.long)
    keep = torch.zeros(batch, n, dtype=torch.bool)
    for row in range(batch):
        found = candidates[row].nonzero().flatten()
        chosen = found[torch.randperm(len(found), generator=gens[row])[:n]].sort().values
        anchors[row, : len(chosen)], keep[row, : len(chosen)] = chosen, True
    return anchors.to(response.device), keep.to(response.device)


def decay_weights(block: int, gamma: float) -> torch.Tensor:
    """``[block]`` float32 slot weights: slot 0 (the anchor) 0, slot ``k >= 1`` ``exp(-(k - 1) / gamma)``."""
    k = torch.arange(block, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def slot_validity(
    anchors: torch.Tensor, keep: torch.Tensor, response: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(label_pos [B, N, block], valid [B, N, block])``: slot ``k`` of anchor ``a`` is labelled by the token
    at ``a + k`` (same position: its hidden drafts that token), clamped into the row; it is scored where the
    block is kept, ``k >= 1`` and positions ``a + 1 .. a + k`` are all response tokens (never past the end
    of the response, nor across a gap into the next turn)."""
    width = response.shape[1]
    k = torch.arange(block, device=anchors.device)
    pos = anchors[..., None] + k  # [B, N, block]
    inside = pos < width
    label_pos = pos.clamp(max=width - 1)
    is_response = torch.gather(response.bool(), 1, label_pos.flatten(1)).view_as(pos) & inside
    run = torch.cumprod(torch.where(k >= 1, is_response, torch.ones_like(is_response)).long(), -1).bool()
    valid = run & (k >= 1) & keep[..., None]
    return label_pos, valid


def block_inputs(
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    response: torch.Tensor,
    *,
    block: int,
    mask_token_id: int,
) -> dict[str, torch.Tensor]:
    """The blocks of ``anchors [B, N]`` over ``input_ids [B, W]`` (``response [B, W]``), flattened to
    ``Q = N * block`` slots per row, block ``n`` at slots ``n * block .. n * block + block - 1``:
    ``tokens [B, Q]`` (the anchor's token, then ``mask_token_id``), ``positions [B, Q]`` (``anchor + j``),
    ``labels [B, Q]`` (the token at ``anchor + k`` where scored, ``IGNORE_INDEX`` elsewhere: slot 0, padded
    blocks, past the response), ``label_pos [B, Q]`` and ``valid [B, Q]`` (``slot_validity``)."""
    batch, n = anchors.shape
    label_pos, valid = slot_validity(anchors, keep, response, block)
    tokens = torch.full((batch, n, block), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    tokens[..., 0] = torch.gather(input_ids, 1, anchors)
    label_ids = torch.gather(input_ids, 1, label_pos.flatten(1)).view_as(label_pos)
    labels = torch.where(valid, label_ids, torch.full_like(label_ids, IGNORE_INDEX))
    positions = anchors[..., None] + torch.arange(block, device=anchors.device)
    return {
        "tokens": tokens.flatten(1),
        "positions": positions.flatten(1),
        "labels": labels.flatten(1),
        "label_pos": label_pos.flatten(1),
        "valid": valid.flatten(1),
    }


def slot_weights(valid: torch.Tensor, block: int, gamma: float) -> torch.Tensor:
    """``valid [B, Q]`` (``Q = N * block``) -> float32 ``[B, Q]``: each scored slot's ``decay_weights``."""
    decay = decay_weights(block, gamma).to(valid.device)
    return decay.repeat(valid.shape[1] // block)[None] * valid


def anchor_weight_sum(
    anchors: torch.Tensor, keep: torch.Tensor, response: torch.Tensor, *, block: int, gamma: float
) -> torch.Tensor:
    """The total slot weight of a batch's blocks (what ``dflash_loss``'s ``weight_sum`` adds up to): a
    trainer divides the accumulated loss by it."""
    valid = slot_validity(anchors, keep, response, block)[1]
    return (decay_weights(block, gamma).to(valid.device) * valid).sum()


def dflash_loss(
    logits: torch.Tensor,
    weights: torch.Tensor,
    *,
    kind: str,
    labels: torch.Tensor | None = None,
    target_logp: torch.Tensor | None = None,
    target_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted loss of the scored slots only: ``logits [M, V]`` (the target's head on the draft's hidden
    states there), ``weights [M]``; ``kind="ce"``: cross-entropy to ``labels [M]``; ``"kl"``: forward
    ``KL(p || q)`` to the target's log-probabilities ``target_logp [U, V]`` (finite), slot ``m`` scored
    against row ``target_rows[m]`` (None: ``U = M``, row ``m``; overlapping blocks share a label position,
    so the target's rows are computed once per position); ``"both"``: their sum.
    Returns ``(sum_m w_m * loss_m`` float32, differentiable; ``sum_m w_m``); the mean is their ratio."""
    if kind not in KINDS:
        raise ValueError(f"loss kind {kind!r}: choose one of {list(KINDS)}")
    log_q = F.log_softmax(logits.float(), dim=-1)  # [M, V]
    per_slot = log_q.new_zeros(log_q.shape[0])
    if kind in ("ce", "both"):
        if labels is None:
            raise ValueError(f"loss kind {kind!r} needs labels")
        per_slot = per_slot - log_q.gather(1, labels[:, None]).squeeze(1)
    if kind in ("kl", "both"):
        if target_logp is None:
            raise ValueError(f"loss kind {kind!r} needs target_logp")
        logp = target_logp.detach().float()
        p = logp.exp()
        neg_entropy = (p * logp).sum(-1)  # [U]: sum p log p
        if target_rows is not None:
            p, neg_entropy = p[target_rows], neg_entropy[target_rows]
        per_slot = per_slot + neg_entropy - (p * log_q).sum(-1)
    return (weights.float() * per_slot).sum(), weights.float().sum().detach()


def block_metrics(
    drafts: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, block: int, slots: int = 4
) -> dict[str, torch.Tensor]:
    """Detached scalar tensors (no host sync): ``acc_k`` for slots ``k = 1 .. slots`` (the share of scored
    slots ``k`` whose draft ``drafts [B, Q]`` is the label) and ``accept_len``: the tokens a round from each
    kept block would yield on average, the leading matching drafts plus the verifier's one."""
    batch = drafts.shape[0]
    valid = valid.view(batch, -1, block)
    match = (drafts == labels).view(batch, -1, block) & valid
    out = {}
    for k in range(1, min(slots, block - 1) + 1):
        out[f"acc_{k}"] = match[..., k].sum() / valid[..., k].sum().clamp(min=1)
    kept = valid[..., 1]
    lead = torch.cumprod(match[..., 1:].long(), -1).sum(-1)  # [B, N]
    out["accept_len"] = 1 + (lead * kept).sum() / kept.sum().clamp(min=1)
    return out
