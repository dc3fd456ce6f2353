"""What a drafter trained beside a frozen target accepts (EAGLE-3, DFlash): measured on the target's own greedy
answers to held-out prompts, never the training data, and recorded in ``final/acceptance.json`` (what ``auto``
plans from). A drafter supplies its greedy drafts from every start of one answer; the rest is here.

``measure`` generates the answers with their features, ``leading_matches`` counts the drafts matching each
answer from each start and ``acceptance_figures`` turns them into per-slot acceptance, acceptance lengths and tokens per round. How a start and a round are
counted: docs/design/methods.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastdecode.plan.acceptance import AcceptanceRecord, DrafterRecord, replay_leads
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training.feature_records import generation_features

# one answer's (lead [n], hits [K], tried [K]): lead[j] = drafts from start j matching the answer; per draft
# index k, the starts whose drafts 0..k all matched / whose 0..k-1 did
Matches = tuple[list[int], list[int], list[int]]


def leading_matches(drafts: torch.Tensor, answer: list[int]) -> Matches:
    """``lead [n]`` from a drafter's greedy drafts ``[n - 1, K]`` along an answer ``a_0 .. a_{n-1}`` (row
    ``j - 1``: the drafts from start ``j``, ``1 <= j < n``, of ``a_j, a_{j+1}, ...``): ``lead[j]`` = how many
    of them match, never past the answer's end (``lead[0]`` = 0: the prefill's token is no round); and
    ``hits``/``tried [K]``: per draft ``k``, the starts whose drafts ``1..k`` all matched / whose ``1..k-1``
    did (and whose draft ``k`` is inside the answer)."""
    n, width = len(answer), drafts.shape[1]
    lead, hits, tried = [0] * n, [0] * width, [0] * width
    for j in range(1, n):
        for k in range(min(width, n - j)):
            tried[k] += 1
            if int(drafts[j - 1, k]) != answer[j + k]:
                break
            hits[k] += 1
            lead[j] += 1
    return lead, hits, tried


def acceptance_figures(
    leads: list[list[int]], hits: list[int], tried: list[int], lengths: Sequence[int]
) -> dict[str, Any]:
    """Per-draft conditional acceptance (draft k accepted given drafts < k were, as speculators reports it),
    acceptance length at each K of ``lengths`` (mean tokens a round from any start yields, the verifier's
    included) and tokens per round for K = 1 .. len(hits) (``replay_leads``: rounds in sequence)."""
    starts = [(lead, j) for lead in leads for j in range(1, len(lead))]
    length = {
        k: sum(min(lead[j], k, len(lead) - 1 - j) + 1 for lead, j in starts) / max(len(starts), 1)
        for k in lengths
    }
    return {
        "conditional_acceptance": [h / t if t else 0.0 for h, t in zip(hits, tried, strict=True)],
        "acceptance_length": length,
        "tokens_per_round": replay_leads(leads, len(hits)),
        "starts": len(starts),
        "answers": len(leads),
        "tokens": sum(len(lead) for lead in leads),
    }


@torch.no_grad()
def measure(
    drafter: torch.nn.Module,
    m: EarlyExitModel,
    prompts: list[list[int]],
    feature_ids: list[int],
    drafts: Callable[[dict], torch.Tensor],
    *,
    width: int,
    lengths: Sequence[int],
    max_new_tokens: int,
    batch_size: int,
    eos: set[int],
) -> dict[str, Any]:
    """The figures of ``acceptance_figures`` for the target's greedy answers to ``prompts``: ``drafts(record)``
    is the drafter's ``[n - 1, width]`` greedy drafts along one generated record (its ``input_ids``,
    ``targets`` and features ``h<i>`` for ``feature_ids``; ``leading_matches``'s rows). The drafter runs in
    eval mode."""
    leads, hits, tried = [], [0] * width, [0] * width
    was_training = drafter.training
    drafter.eval()
    try:
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b : b + batch_size]
            for record in generation_features(
                m, batch, feature_ids, 1, torch.float32, max_new_tokens=max_new_tokens, eos=eos
            ):
                if len(record["targets"]) < 2:
                    continue  # no round: the prefill's token ends the answer
                lead, h, t = leading_matches(drafts(record), record["targets"].tolist())
                leads.append(lead)
                hits = [a + b for a, b in zip(hits, h, strict=True)]
                tried = [a + b for a, b in zip(tried, t, strict=True)]
    finally:
        drafter.train(was_training)
    return acceptance_figures(leads, hits, tried, lengths)


def drafter_record(figures: dict[str, Any], measured_on: str, drafter: str) -> AcceptanceRecord:
    """``acceptance.json``'s content: one drafter (its first draft's acceptance and tokens per round of its
    first K drafts)."""
    first = figures["conditional_acceptance"][0] if figures["conditional_acceptance"] else 0.0
    record = DrafterRecord(drafter=drafter, acceptance=first, tokens_per_round=figures["tokens_per_round"])
    return AcceptanceRecord([record], measured_on, figures["tokens"])


def table_text(figures: dict[str, Any], title: str) -> str:
    """The figures as a short table (logged at the end of a run)."""
    cond = figures["conditional_acceptance"]
    rounds = figures["tokens_per_round"]
    lines = [
        f"{title} on {figures['answers']} held-out answers ({figures['starts']} starts):",
        "  draft k          " + " ".join(f"{k:>6d}" for k in range(1, len(cond) + 1)),
        "  acceptance      " + " ".join(f"{a:6.3f}" for a in cond),
        "  tokens/round K  " + " ".join(f"{rounds[k]:6.3f}" for k in sorted(rounds)),
        "  acceptance length "
        + ", ".join(f"K={k}: {v:.3f}" for k, v in figures["acceptance_length"].items()),
    ]
    return "\n".join(lines)
