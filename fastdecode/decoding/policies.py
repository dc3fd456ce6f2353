"""Draft-length policies: how many tokens a proposer may draft per round, and whether to draft one more.

A ``DraftPolicy`` gives ``draft_limit`` before a round, decides per drafted token in ``keep_drafting``
(dynamic policies only) and learns from ``update``; ``POLICIES`` names them for ``decoder.policy``.
``LaggedFlag`` brings a dynamic policy's decision, a device tensor, to the host one draft token late, so
drafting never waits on a sync per token. Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch


class DraftPolicy:
    """Base of the draft-length policies: draft ``max_tokens`` = K per round, no per-token decision, nothing
    learnt from a round. Subclasses override the hooks they need; every policy takes the same arguments
    (``threshold``: ``confidence``'s stop probability; ``marginal[j]``: what the (j+1)-th drafted token adds
    to a round's cost in plain decoding steps, from ``fastdecode/plan/cost.py``, for ``adaptive``), so a decoder
    builds any of them from ``POLICIES`` alike. ``cost_aware``: proposers that know a whole draft at once
    (n-gram lookups) cut it where the cost model expects the most tokens per cost."""

    dynamic: ClassVar[bool] = False  # True: decides per drafted token in ``keep_drafting``
    cost_aware: ClassVar[bool] = False

    def __init__(
        self, max_tokens: int, *, threshold: float = 0.4, marginal: Sequence[float] | None = None
    ) -> None:
        self.k = max_tokens

    def draft_limit(self) -> int:
        """The most tokens the next draft may have (the decoder also caps it by the tokens left)."""
        return self.k

    def begin(self) -> None:
        """Called before each round's draft (whoever drafts it); dynamic policies reset their per-draft state
        here, so ``update`` never books a round against an earlier draft's confidences."""

    def keep_drafting(self, confidence: torch.Tensor, active: torch.Tensor) -> torch.Tensor | None:
        """``confidence [B]``: drafter probability of the token just drafted, ``active [B]`` bool: rows still
        decoding -> 0-d device bool (draft another token?), or None: no per-token decision."""
        return None

    def update(self, accepted: list[int | None], drafted: list[int | None]) -> None:
        """After verification: accepted and drafted tokens per row (None for rows that no longer decode)."""


class Constant(DraftPolicy):
    """Always draft K tokens (the base behaviour, unchanged)."""


class Heuristic(DraftPolicy):
    """Hugging Face's ``heuristic`` schedule: K += 2 after a fully accepted draft, else K = max(1, K - 1).

    K starts at ``draft_tokens`` and, as in HF, is not capped (the decoder caps it by the tokens left).
    In a batch a draft counts as fully accepted when every active row accepted all of it.
    """

    def update(self, accepted: list[int | None], drafted: list[int | None]) -> None:
        rows = [(a, d) for a, d in zip(accepted, drafted, strict=True) if a is not None]
        if not rows:  # nothing of this proposer's was verified (a chain's round drafted by the lookup)
            return
        if all(a == d for a, d in rows):
            self.k += 2
        else:
            self.k = max(1, self.k - 1)


class Confidence(DraftPolicy):
    """HF's dynamic speculation: stop after a drafted token whose drafter probability is below ``threshold``
    (that token stays in the draft); at most K tokens."""

    dynamic: ClassVar[bool] = True

    def __init__(
        self, max_tokens: int, *, threshold: float = 0.4, marginal: Sequence[float] | None = None
    ) -> None:
        super().__init__(max_tokens)
        self.threshold = threshold

    def keep_drafting(self, confidence: torch.Tensor, active: torch.Tensor) -> torch.Tensor | None:
        return ((confidence >= self.threshold) & active).any()


class Adaptive(DraftPolicy):
    """Cost-aware stop: after the j-th drafted token, draft another while the estimated probability that the
    whole draft so far is accepted exceeds what one more token adds to the round's cost, ``marginal[j]`` (the
    drafted token plus the growth of the verification, ``fastdecode/plan/cost.py``); at most K.

    Why: token j+1 can only count if tokens 1..j are all accepted. The estimate is the product of the
    drafter's confidences, each scaled by a running calibration factor ``r`` = accepted drafts / summed
    confidence of the labelled drafts (accepted ones and the first rejected one per round), with one
    pseudo-count each so that ``r`` starts at 1. ``r`` stays on the device. Proposers that know their whole
    draft at once (``cost_aware``) cut it with ``fastdecode.plan.cost.best_draft_length`` instead.
    """

    dynamic: ClassVar[bool] = True
    cost_aware: ClassVar[bool] = True

    def __init__(
        self, max_tokens: int, *, threshold: float = 0.4, marginal: Sequence[float] | None = None
    ) -> None:
        super().__init__(max_tokens)
        self.marginal = list(marginal) if marginal is not None else [0.5] * max_tokens
        self.accepted_total = 1.0
        self.confidence_total: torch.Tensor | None = None  # device scalar, set on first use
        self.product: torch.Tensor | None = None  # [B] estimate for the current draft
        self.confidences: list[torch.Tensor] = []  # [B] per drafted token of the current draft

    def begin(self) -> None:
        self.product = None
        self.confidences = []

    def keep_drafting(self, confidence: torch.Tensor, active: torch.Tensor) -> torch.Tensor | None:
        if self.confidence_total is None:
            self.confidence_total = torch.ones((), device=confidence.device)
        self.confidences.append(confidence)
        calibration = self.accepted_total / self.confidence_total
        step = (confidence * calibration).clamp(max=1.0)
        self.product = step if self.product is None else self.product * step
        drafted = len(self.confidences)
        cost = self.marginal[min(drafted, len(self.marginal) - 1)]
        return ((self.product > cost) & active).any()

    def update(self, accepted: list[int | None], drafted: list[int | None]) -> None:
        if not self.confidences:
            return
        confidences = torch.stack(self.confidences, 1)  # [B, k]
        k = confidences.shape[1]
        self.accepted_total += sum(a for a in accepted if a is not None)
        # Labelled drafts per row: the accepted ones and the first rejected one (rows not decoding: none).
        counts = torch.tensor(
            [0 if a is None else min(a + 1, d, k) for a, d in zip(accepted, drafted, strict=True)],
            device=confidences.device,
        )
        labelled = torch.arange(k, device=confidences.device)[None, :] < counts[:, None]
        self.confidence_total = self.confidence_total + (confidences * labelled).sum()


POLICIES: dict[str, type[DraftPolicy]] = {
    "constant": Constant,
    "heuristic": Heuristic,
    "confidence": Confidence,
    "adaptive": Adaptive,
}


class LaggedFlag:
    """A device bool that the host reads one draft token after it was computed: ``push`` starts a
    non-blocking copy, ``read`` comes after the next token's pass was launched (docs/design/decoding.md)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.buffers = [torch.ones((), dtype=torch.bool, pin_memory=self.cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self.slot = 0
        self.pending: int | None = None

    def reset(self) -> None:
        """Forget the pending flag (at the start of each draft)."""
        self.pending = None

    def push(self, flag: torch.Tensor) -> None:
        """Start copying ``flag`` (0-d bool on the device) to the host without waiting for it."""
        slot = self.slot
        self.buffers[slot].copy_(flag, non_blocking=True)
        if self.cuda:
            self.events[slot].record()
        self.pending, self.slot = slot, 1 - slot

    def read(self) -> bool:
        """The last pushed flag (True if none): waits only for the copy, queued before the newest work."""
        if self.pending is None:
            return True
        if self.cuda:
            self.events[self.pending].synchronize()
        return bool(self.buffers[self.pending])
