"""The adapter's loss: KL to the final layer's distribution over the drafter's head rows, plus optional CE.

The drafter's head scores ``S`` rows (the draft vocabulary, or all ``V``). ``kl_full`` takes the teacher's
logits over the same rows; ``kl_topk`` takes the cached top-k log-probabilities, restricted to the head and
renormalised. Both are scaled by ``T^2``. ``cross_entropy`` and ``agreement`` score rows of the head too.
Why these targets are exact: docs/design/methods.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_full(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean KL(teacher || student) of ``[M, S]`` logits at ``temperature``."""
    log_q = F.log_softmax(student.float() / temperature, -1)
    log_p = F.log_softmax(teacher.float() / temperature, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl.mean() * temperature**2


def kl_topk(
    student: torch.Tensor,
    topk_rows: torch.Tensor,
    topk_logp: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean KL of the teacher's renormalised top-k (rows ``topk_rows [M, k]`` into the student's head, -1 =
    not in it; log-probabilities ``topk_logp [M, k]``) against the student's ``[M, S]`` logits. Positions
    with no top-k token in the head are skipped."""
    inside = topk_rows >= 0
    keep = inside.any(-1)
    if not keep.any():
        return student.sum() * 0.0
    log_q = F.log_softmax(student[keep].float() / temperature, -1)
    rows, logp, inside = topk_rows[keep].clamp_min(0), topk_logp[keep] / temperature, inside[keep]
    log_p = torch.log_softmax(logp.masked_fill(~inside, float("-inf")), -1)
    p = log_p.exp()
    kl = (p * (log_p.masked_fill(~inside, 0.0) - log_q.gather(-1, rows))).masked_fill(~inside, 0.0).sum(-1)
    return kl.mean() * temperature**2


def cross_entropy(student: torch.Tensor, target_rows: torch.Tensor) -> torch.Tensor:
    """Mean CE of ``[M, S]`` logits on rows ``target_rows [M]`` (-1: not in the head, skipped)."""
    keep = target_rows >= 0
    if not keep.any():
        return student.sum() * 0.0
    return F.cross_entropy(student[keep].float(), target_rows[keep])


@torch.no_grad()
def agreement(student: torch.Tensor, teacher_rows: torch.Tensor) -> torch.Tensor:
    """Share of positions whose student argmax is the teacher's full-vocabulary argmax (row, -1 if outside)."""
    return (student.argmax(-1) == teacher_rows).float().mean()
