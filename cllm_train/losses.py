"""CLLM losses (Kou et al., 2024, "CLLMs: Consistency Large Language Models", arXiv:2403.00835) on logits.

``consistency_loss``: the KL from the teacher's (stop-gradient) distribution to the student's, over the block
positions ``consistency_positions`` marks. ``ar_loss``: cross-entropy with label smoothing. Each returns a
``Term``: the sum over its tokens divided by ``num_items`` when given, else by its own count, so a
gradient-accumulated step equals one large batch. Notation and derivation: docs/design/methods.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastdecode.tokens import IGNORE_INDEX


class Term(NamedTuple):
    """``loss``: the normalised sum to backpropagate; ``mean``: detached per-token mean of this call (logs);
    ``count``: tokens scored in this call."""

    loss: torch.Tensor
    mean: torch.Tensor
    count: int


def consistency_positions(
    first_mismatch: torch.Tensor, block_len: torch.Tensor, block_start: int, width: int
) -> torch.Tensor:
    """``K`` as a mask: ``[B, W]`` bool, True at columns ``block_start + m - 1 .. block_start + n - 2``.

    Args:
        first_mismatch: ``[B]`` ``m`` of the student state per row; ``m == n`` (a fixed point, or no state
            drawn) gives an empty row.
        block_len: ``[B]`` block size ``n`` per row.
        block_start: column ``P`` of the first block token (the prefix is left-padded to ``P`` columns).
        width: ``W`` columns of the sequences.
    """
    cols = torch.arange(width, device=first_mismatch.device)[None, :]  # [1, W]
    first = (block_start + first_mismatch - 1)[:, None]  # [B, 1]
    last = (block_start + block_len - 2)[:, None]  # [B, 1]: inclusive
    return (cols >= first) & (cols <= last)


def consistency_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per-position ``KL(softmax(sg(teacher)) || softmax(student))``: ``[N, V]`` x2 -> ``[N]`` (float32).

    The teacher is detached here too, so no caller can backpropagate into it by mistake.
    """
    log_q = F.log_softmax(student.float(), dim=-1)
    log_p = F.log_softmax(teacher.detach().float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def consistency_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor | None = None,
    num_items: int | torch.Tensor | None = None,
) -> Term:
    """Consistency loss of student logits against teacher logits.

    Args:
        student: ``[..., V]`` logits with gradient (``[B, T, V]`` with ``mask``, or already gathered ``[N, V]``).
        teacher: same shape; used detached.
        mask: ``[...]`` bool, the positions ``K`` to score (``consistency_positions``); None: every position.
        num_items: denominator (positions in the accumulated batch); None: this call's positions.
    """
    if mask is not None:
        student, teacher = student[mask], teacher[mask]  # [N, V]
    student = student.reshape(-1, student.shape[-1])
    teacher = teacher.reshape(-1, teacher.shape[-1])
    count = student.shape[0]
    total = consistency_kl(student, teacher).sum()
    return _term(total, count, num_items)


def ar_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    label_smoothing: float = 0.1,
    num_items: int | torch.Tensor | None = None,
) -> Term:
    """Cross-entropy with label smoothing: ``(1 - e) * nll + e * mean_v(-log q_v)`` per scored token.

    Args:
        logits: ``[..., V]``.
        targets: ``[...]`` next-token ids aligned with ``logits`` (``fastdecode.tokens.next_token_targets``);
            ``IGNORE_INDEX`` is ignored.
        label_smoothing: ``e`` (the reference uses 0.1).
        num_items: denominator (target tokens in the accumulated batch); None: this call's target tokens.
    """
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    keep = targets != IGNORE_INDEX
    logits, targets = logits[keep], targets[keep]
    total = F.cross_entropy(logits.float(), targets, reduction="sum", label_smoothing=label_smoothing)
    return _term(total, targets.numel(), num_items)


def _term(total: torch.Tensor, count: int, num_items: int | torch.Tensor | None) -> Term:
    """Normalise a summed loss; with nothing to score the loss is 0 (still in the graph, for DDP)."""
    if count == 0:
        total = total.nan_to_num(0.0) * 0  # an empty cross-entropy sum is 0 already; a mean would be NaN
    denom = num_items if num_items is not None else max(count, 1)
    if torch.is_tensor(denom):
        denom = denom.clamp(min=1)
    else:
        denom = max(denom, 1)
    return Term(total / denom, total.detach() / max(count, 1), count)
