"""The EAGLE-3 training-time test (TTT) loss (Li et al., 2025, "Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"), as pure functions of a head and a batch.

A batch is what one forward of the frozen target over ``input_ids`` gives (one sequence per row,
right-padded). ``ttt_unroll`` runs the head's steps; ``ttt_loss`` scores step ``k`` against the target's
distribution, weighted by ``decay ** k``. Losses return ``(sum, count)``, not means. The batch fields and
the alignment: docs/design/methods.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from fastdecode.drafters.eagle3.layer import Eagle3KV, ttt_mask
from fastdecode.drafters.eagle3.model import Eagle3Head
from fastdecode.tokens import IGNORE_INDEX

KINDS = ("kl", "ce")


def target_draft_distribution(target_logits: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """The target's distribution restricted to the draft vocabulary and renormalised there (as speculators
    and SpecForge score ``kl``): ``target_logits [B, T, V]``, ``t2d`` bool ``[V]`` -> float32 log-probs
    ``[B, T, Vd]``, column ``d`` for the ``d``-th smallest target id in the draft vocabulary (the draft id
    order of ``fastdecode.drafters.eagle3.model.vocab_maps``)."""
    return F.log_softmax(target_logits[..., t2d.bool()].float(), dim=-1)


def target_draft_argmax(target_logits: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """The target's argmax as a draft id: ``target_logits [B, T, V]``, ``t2d`` bool ``[V]`` -> int64
    ``[B, T]``, ``IGNORE_INDEX`` (-100) where the argmax is outside the draft vocabulary."""
    t2d = t2d.bool()
    top = target_logits.argmax(dim=-1)
    draft_id = torch.cumsum(t2d.long(), dim=0) - 1  # [V]: a target id's draft id, where t2d holds
    return torch.where(t2d[top], draft_id[top], torch.full_like(top, IGNORE_INDEX))


def shift_ahead(x: torch.Tensor, n: int, length: int, fill: float | bool = 0) -> torch.Tensor:
    """``x [B, T, ...]`` -> ``[B, length, ...]`` whose row ``i`` is ``x[:, i + n]`` (``fill`` past the end)."""
    part = x[:, n : n + length]
    pad = x.new_full((x.shape[0], length - part.shape[1], *x.shape[2:]), fill)
    return torch.cat([part, pad], dim=1)


def step_loss(
    draft_logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, kind: str
) -> tuple[torch.Tensor, int]:
    """One TTT step's loss, summed over the scored positions, and their count.

    ``draft_logits [B, T, Vd]``; ``mask`` bool ``[B, T]``: the positions to score. ``kind="kl"``: ``target``
    is the target's draft-vocabulary log-probs ``[B, T, Vd]``, loss ``KL(p || q) = sum p (log p - log q)``
    (forward KL, target ``p``, draft ``q``). ``kind="ce"``: ``target`` is draft ids ``[B, T]``, loss the
    cross-entropy on them; ``IGNORE_INDEX`` ids are not scored nor counted.
    Returns ``(sum, count)``: a float32 scalar (differentiable) and the number of scored positions.
    """
    if kind not in KINDS:
        raise ValueError(f"loss kind {kind!r}: choose one of {list(KINDS)}")
    if kind == "ce":
        mask = mask & (target != IGNORE_INDEX)
    count = int(mask.sum())
    log_q = F.log_softmax(draft_logits[mask].float(), dim=-1)  # [N, Vd]
    if kind == "ce":
        return F.nll_loss(log_q, target[mask], reduction="sum"), count
    log_p = target[mask].float()  # [N, Vd]
    p = log_p.exp()
    kl = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return kl.sum(), count


def ttt_unroll(
    head: Eagle3Head,
    embeds: torch.Tensor,
    features: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    steps: int,
) -> list[torch.Tensor]:
    """The head unrolled for ``steps`` TTT steps over paired rows -> draft logits ``[B, T, Vd]`` per step.

    ``embeds [B, T, H]`` (row ``t``: the embedding of that row's token), ``features [B, T, 3 * Ht]`` (row
    ``t``: the target features paired with it), ``position_ids [B, T]``. Step 0 is ``head.forward`` over
    the rows (causal). Step ``k > 0`` reads ``embeds`` ``k`` rows ahead (zeros past the end), positions
    ``+ k`` and step ``k-1``'s output hidden states; all steps share one ``Eagle3KV`` under ``ttt_mask(T,
    k)``, so row ``t`` at step ``k`` sees rows ``<= t`` of step 0 and its own row of steps ``1 .. k``: the
    keys a chain draft from row ``t`` has. ``embeds`` and ``features`` are detached (the target is frozen).
    """
    if steps < 1:
        raise ValueError(f"ttt steps must be >= 1, got {steps}")
    length = embeds.shape[1]
    embeds, hidden = embeds.detach(), features.detach()
    kv = Eagle3KV()
    out = []
    for k in range(steps):
        mask = ttt_mask(length, k, embeds.device)
        logits, hidden = head(shift_ahead(embeds, k, length), hidden, position_ids + k, kv, mask)
        out.append(logits)
    return out


def batch_targets(batch: Mapping[str, torch.Tensor], t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs [B, T, Vd], draft ids [B, T])`` of the target at each position of ``batch``: from its
    ``target_logits``, or its precomputed ``target_logp`` and ``target_ids``."""
    if "target_logits" in batch:
        logits = batch["target_logits"].detach()
        return target_draft_distribution(logits, t2d), target_draft_argmax(logits, t2d)
    if "target_logp" in batch and "target_ids" in batch:
        return batch["target_logp"].detach().float(), batch["target_ids"]
    raise KeyError("an EAGLE-3 batch needs target_logits, or both target_logp and target_ids")


def check_draft_order(head: Eagle3Head) -> None:
    """Refuse a head whose draft ids are not in ascending target-id order: the columns of
    ``target_draft_distribution`` (``t2d`` order) would not be its ``lm_head`` rows."""
    targets = head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=head.d2t.device))
    if not bool((targets[1:] > targets[:-1]).all()):
        raise ValueError(
            "the head's draft vocabulary is not in ascending target-id order (d2t); rebuild it with "
            "fastdecode.drafters.eagle3.model.vocab_maps or Eagle3Head.set_draft_vocab"
        )


def ttt_loss(
    head: Eagle3Head,
    batch: Mapping[str, torch.Tensor],
    *,
    steps: int = 3,
    decay: float = 0.8,
    kind: str = "kl",
    prev_correct: bool = False,
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """The TTT loss of ``head`` on ``batch`` (fields and alignment: docs/design/methods.md).

    Returns ``(loss_sum, count, metrics)``: ``loss_sum = sum_k decay**k * sum_k`` (float32, differentiable),
    ``count`` the step-0 scored positions (divide the accumulated ``loss_sum`` by the accumulated ``count``),
    and per step ``k``, as detached scalar tensors (no host sync: a trainer converts them when it logs):
    ``loss_k`` (that step's mean), ``acc_k`` (share of its scored positions where the
    draft's argmax is the target's argmax; one outside the draft vocabulary is a miss), ``count_k``.
    ``prev_correct``: step ``k`` scores a row only where steps ``0 .. k-1`` all matched the target's argmax
    (an option of speculators; off by default).
    """
    if kind not in KINDS:
        raise ValueError(f"loss kind {kind!r}: choose one of {list(KINDS)}")
    check_draft_order(head)
    ids = batch["input_ids"]
    length = ids.shape[1]
    rows = length - 1
    if rows < 1:
        raise ValueError(f"an EAGLE-3 batch needs sequences of >= 2 tokens, got {length}")
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device).expand_as(ids)
    logp, top = batch_targets(batch, head.t2d)
    logits = ttt_unroll(
        head, batch["embeds"][:, 1:], batch["features"][:, :-1], positions[:, 1:], steps=steps
    )
    alive = torch.ones_like(ids[:, 1:], dtype=torch.bool)
    loss_sum, count, metrics = logits[0].new_zeros((), dtype=torch.float32), 0, {}
    for k, step_logits in enumerate(logits):
        valid = shift_ahead(batch["loss_mask"].bool(), 2 + k, rows, False) & alive
        step_ids = shift_ahead(top, 1 + k, rows, IGNORE_INDEX)
        target = step_ids if kind == "ce" else shift_ahead(logp, 1 + k, rows)
        s, n = step_loss(step_logits, target, valid, kind)
        correct = step_logits.argmax(dim=-1) == step_ids
        loss_sum = loss_sum + decay**k * s
        count = n if k == 0 else count
        scored = valid.sum().clamp(min=1)
        metrics[f"loss_{k}"] = s.detach() / max(n, 1)
        metrics[f"acc_{k}"] = (correct & valid).sum() / scored
        metrics[f"count_{k}"] = torch.tensor(float(n), device=s.device)
        if prev_correct:
            alive = alive & correct
    return loss_sum, count, metrics
