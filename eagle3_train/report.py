"""What a trained head accepts when it drafts chains: measured on the target's own greedy answers to held-out
prompts (never the training data), recorded in ``final/acceptance.json`` (what ``auto`` plans from).

``measure`` generates the answers with their features; ``leading_matches`` unrolls the head on each answer as
chain drafting runs it and counts how many drafts from each start match; ``acceptance_figures`` sums them up.
How a start and a round are counted: docs/design/methods.md.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from eagle3_train.losses import ttt_unroll
from fastdecode.drafters.eagle3.model import Eagle3Head
from fastdecode.plan.acceptance import MAX_REPLAYED_DRAFT, AcceptanceRecord, DrafterRecord, replay_leads
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training.feature_records import generation_features

log = logging.getLogger(__name__)
LENGTHS = (3, 5)  # acceptance length reported at these draft lengths


@torch.no_grad()
def leading_matches(head: Eagle3Head, m: EarlyExitModel, record: dict, aux: list[int], max_draft: int):
    """``lead [n]`` for one generated record (prompt + answer of ``n`` tokens): ``lead[j]`` = how many
    chain drafts from start j (``1 <= j < n``) equal the answer's next tokens, at most ``max_draft`` and
    never past the answer's end (``lead[0]`` = 0: the prefill's token is no round); and ``hits [K]``/
    ``tried [K]``: per draft index k, the starts whose drafts ``0..k`` all matched / whose ``0..k-1`` did."""
    answer = record["targets"].long()
    n, ids = len(answer), torch.cat([record["input_ids"].long(), answer[-1:]])
    prompt = len(ids) - n
    features = torch.cat([record[f"h{a}"].float() for a in aux], dim=-1)[None].to(m.device)  # [1, T, 3H]
    tokens = ids[1:][None].to(m.device)  # row i holds token x_{i+1}
    positions = torch.arange(1, len(ids), device=m.device)[None]
    embeds = m.token_embed(tokens).float()
    logits = ttt_unroll(head, embeds, features, positions, steps=max_draft)
    drafts = torch.stack([head.draft_to_target(s[0].argmax(-1)) for s in logits]).cpu()  # [K, T]
    lead = [0] * n
    hits, tried = [0] * max_draft, [0] * max_draft
    for j in range(1, n):
        row = prompt + j - 2  # the row whose token is a_{j-1}; draft k there predicts a_{j+k}
        for k in range(min(max_draft, n - j)):
            tried[k] += 1
            if int(drafts[k, row]) != int(ids[prompt + j + k]):
                break
            hits[k] += 1
            lead[j] += 1
    return lead, hits, tried


def acceptance_figures(leads: list[list[int]], hits: list[int], tried: list[int]) -> dict[str, Any]:
    """Per-position conditional acceptance (draft k accepted given drafts < k were, as speculators reports
    it), acceptance length at K in ``LENGTHS`` (the mean tokens a round from any start yields, the
    verifier's included) and tokens per round for K = 1..8."""
    starts = [(lead, j) for lead in leads for j in range(1, len(lead))]
    length = {
        k: sum(min(lead[j], k, len(lead) - 1 - j) + 1 for lead, j in starts) / max(len(starts), 1)
        for k in LENGTHS
    }
    return {
        "conditional_acceptance": [h / t if t else 0.0 for h, t in zip(hits, tried, strict=True)],
        "acceptance_length": length,
        "tokens_per_round": replay_leads(leads, len(hits)),
        "starts": len(starts),
        "answers": len(leads),
        "tokens": sum(len(lead) for lead in leads),
    }


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
    """The figures of ``acceptance_figures`` for the target's greedy answers to ``prompts``."""
    leads, hits, tried = [], [0] * MAX_REPLAYED_DRAFT, [0] * MAX_REPLAYED_DRAFT
    was_training = head.training
    head.eval()
    try:
        for b in range(0, len(prompts), batch_size):
            records = generation_features(
                m, prompts[b : b + batch_size], aux, 1, torch.float32, max_new_tokens=max_new_tokens, eos=eos
            )
            for record in records:
                if len(record["targets"]) < 2:
                    continue  # no round: the prefill's token ends the answer
                lead, h, t = leading_matches(head, m, record, aux, MAX_REPLAYED_DRAFT)
                leads.append(lead)
                hits = [a + b for a, b in zip(hits, h, strict=True)]
                tried = [a + b for a, b in zip(tried, t, strict=True)]
    finally:
        head.train(was_training)
    return acceptance_figures(leads, hits, tried)


def drafter_record(figures: dict[str, Any], measured_on: str) -> AcceptanceRecord:
    """``acceptance.json``'s content: one drafter ``eagle3`` (its first draft's acceptance and tokens per
    round of K chain drafts)."""
    first = figures["conditional_acceptance"][0] if figures["conditional_acceptance"] else 0.0
    drafter = DrafterRecord(drafter="eagle3", acceptance=first, tokens_per_round=figures["tokens_per_round"])
    return AcceptanceRecord([drafter], measured_on, figures["tokens"])


def table_text(figures: dict[str, Any]) -> str:
    """The figures as a short table (logged at the end of a run)."""
    cond = figures["conditional_acceptance"]
    rounds = figures["tokens_per_round"]
    lines = [
        f"EAGLE-3 chain drafting on {figures['answers']} held-out answers ({figures['starts']} starts):",
        "  draft k          " + " ".join(f"{k:>6d}" for k in range(1, len(cond) + 1)),
        "  acceptance      " + " ".join(f"{a:6.3f}" for a in cond),
        "  tokens/round K  " + " ".join(f"{rounds[k]:6.3f}" for k in sorted(rounds)),
        "  acceptance length "
        + ", ".join(f"K={k}: {v:.3f}" for k, v in figures["acceptance_length"].items()),
    ]
    return "\n".join(lines)
