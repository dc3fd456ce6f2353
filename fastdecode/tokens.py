"""The next-token label convention, in one place for the data pipeline, the losses and the reports.

Labels follow Hugging Face: ``labels [B, T]`` are aligned with ``input_ids`` (not shifted) and the logits at
position ``t`` are trained on ``labels[:, t + 1]``; ``IGNORE_INDEX`` marks a position with no loss (prompt
tokens, padding, the first token of a packed sample). Everything that scores labels shifts them with
``next_token_targets`` and turns summed negative log-likelihoods into a perplexity with ``perplexity``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # torch's cross_entropy default ignore_index, and the HF label convention
MAX_LOG_PERPLEXITY = 50.0  # exp(50) ~ 5e21: an untrained or diverged model reports a number, not inf


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """``labels [..., T]`` (aligned with the inputs) -> targets ``[..., T]``: column ``t`` holds label ``t + 1``.

    The last column has no next token and becomes ``IGNORE_INDEX``, so targets keep the inputs' shape and
    line up with hidden states or logits ``[..., T, *]`` position by position.
    """
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def next_token_nll(
    hidden: torch.Tensor, labels: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL of the labelled positions and their count.

    Args:
        hidden: ``[B, T, H]`` states (or ``[B, T, V]`` logits with ``head`` the identity).
        labels: ``[B, T]`` HF-style labels (shifted here).
        head: ``[N, H] -> [N, V]`` logits; it runs on the ``N`` scored positions only, never on ``[B, T, V]``.
    Returns: ``(sum, N)``: a float32 scalar (differentiable) and the number of scored tokens.
    """
    targets = next_token_targets(labels)  # [B, T]
    scored = targets != IGNORE_INDEX  # [B, T]
    logits = head(hidden[scored]).float()  # [N, V]
    return F.cross_entropy(logits, targets[scored], reduction="sum"), int(scored.sum())


def perplexity(nll: float, tokens: int) -> float | None:
    """``exp(nll / tokens)`` (capped at ``exp(MAX_LOG_PERPLEXITY)``); None when nothing was scored."""
    if tokens <= 0:
        return None
    return math.exp(min(nll / tokens, MAX_LOG_PERPLEXITY))


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokenizer's EOS and the model's generation-config EOS ids: where every method stops."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = model.generation_config.eos_token_id
    return ids | (set(extra) if isinstance(extra, list) else ({extra} if extra is not None else set()))
