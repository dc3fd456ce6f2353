"""What a trained head accepts when it drafts chains (``fastdecode.training.drafter_report``, recorded as
drafter ``eagle3``): ``chain_drafts`` unrolls the head over an answer as chain drafting runs it, every start
at once.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3_train.losses import ttt_unroll
from fastdecode.drafters.eagle3.model import Eagle3Head
from fastdecode.plan.acceptance import MAX_REPLAYED_DRAFT
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training import drafter_report

LENGTHS = (3, 5)  # acceptance length reported at these draft lengths


@torch.no_grad()
def chain_drafts(
    head: Eagle3Head, m: EarlyExitModel, record: dict, aux: list[int], max_draft: int
) -> torch.Tensor:
    """The chain drafts ``[n - 1, max_draft]`` along one generated record (prompt + answer ``a_0 .. a_{n-1}``):
    row ``j - 1`` holds the ``max_draft`` drafts chain drafting makes from start ``j`` (after ``a_{j-1}``), of
    ``a_j, a_{j+1}, ...``; the head is unrolled over the whole answer at once (``ttt_unroll``)."""
    answer = record["targets"].long()
    n, ids = len(answer), torch.cat([record["input_ids"].long(), answer[-1:]])
    prompt = len(ids) - n
    features = torch.cat([record[f"h{a}"].float() for a in aux], dim=-1)[None].to(m.device)  # [1, T, 3H]
    tokens = ids[1:][None].to(m.device)  # row i holds token x_{i+1}
    positions = torch.arange(1, len(ids), device=m.device)[None]
    embeds = m.token_embed(tokens).float()
    logits = ttt_unroll(head, embeds, features, positions, steps=max_draft)
    drafts = torch.stack([head.draft_to_target(s[0].argmax(-1)) for s in logits]).cpu()  # [K, T]
    return drafts[:, prompt - 1 : prompt + n - 2].T  # start j: the row whose token is a_{j-1}


def measure(
    head: Eagle3Head,
    m: EarlyExitModel,
    prompts: list[list[int]],
    aux: list[int],
    *,
    max_new_tokens: int,
    batch_size: int,
    eos: set[int],
) -> dict[str, Any]:
    """Per-draft acceptance, acceptance length at ``LENGTHS`` and tokens per round for K = 1..8
    (``fastdecode.training.drafter_report``) on the target's greedy answers."""
    return drafter_report.measure(
        head,
        m,
        prompts,
        aux,
        lambda record: chain_drafts(head, m, record, aux, MAX_REPLAYED_DRAFT),
        width=MAX_REPLAYED_DRAFT,
        lengths=LENGTHS,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        eos=eos,
    )
