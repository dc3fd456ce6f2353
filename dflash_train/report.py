"""What a trained DFlash drafter accepts: measured on the target's own greedy answers to held-out prompts (never
the training data), recorded in ``final/acceptance.json`` as drafter ``dflash`` (what ``auto`` plans from).

``measure`` generates the answers with their features; ``block_drafts`` drafts the block at every anchor of an
answer in one forward (``block_mask``), each from the features of the tokens before its anchor, exactly the
block greedy decoding drafts there; ``leading_matches`` counts the drafts matching the answer from each start;
``acceptance_figures`` sums them up. How a start and a round are counted: docs/design/methods.md.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dflash_train.losses import block_inputs
from fastdecode.drafters.dflash.layer import DFlashDraft, block_mask
from fastdecode.plan.acceptance import AcceptanceRecord, DrafterRecord, replay_leads
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training.feature_records import generation_features

log = logging.getLogger(__name__)
LENGTHS = (3, 7, 15)  # acceptance length reported at these draft lengths (those below the block) and B - 1
HEAD_ROWS = 1024  # slots per LM-head product (bounds the logits' memory at a large vocabulary)


@torch.no_grad()
def block_drafts(draft: DFlashDraft, m: EarlyExitModel, record: dict, feature_ids: list[int]) -> torch.Tensor:
    """The drafts ``[n - 1, B - 1]`` of one generated record (prompt + answer ``a_0 .. a_{n-1}``): row
    ``j - 1`` is the block anchored at ``a_{j-1}`` (position ``P + j - 1``; start ``j``, ``1 <= j < n``), its
    column ``k - 1`` the greedy draft of slot ``k``, i.e. of ``a_{j-1+k}``; the context is the target's
    features of every token before the anchor, as decoding has them after verifying ``a_{j-1}``'s prefix."""
    cfg = draft.config
    answer = record["targets"].long()
    n, ids = len(answer), torch.cat([record["input_ids"].long(), answer[-1:]])
    prompt = len(ids) - n
    device, dtype = m.device, next(draft.parameters()).dtype
    features = torch.cat([record[f"h{e}"] for e in feature_ids], dim=-1)[None].to(device, dtype)  # [1, T, kH]
    anchors = torch.arange(prompt, prompt + n - 1, device=device)[None]
    keep = torch.ones_like(anchors, dtype=torch.bool)
    response = (torch.arange(len(ids), device=device) >= prompt)[None]
    blocks = block_inputs(
        ids[None].to(device), anchors, keep, response, block=cfg.block_size, mask_token_id=cfg.mask_token_id
    )
    context = features.shape[1]
    kv = draft.context_kv(features, torch.arange(context, device=device)[None])
    mask = block_mask(anchors, keep, context, cfg.block_size)
    hidden = draft(m.token_embed(blocks["tokens"]).to(dtype), blocks["positions"], kv, mask)
    slots = hidden.view(n - 1, cfg.block_size, -1)[:, 1:].reshape(-1, hidden.shape[-1])
    out = torch.cat([m.head_logits(part.to(m.dtype)).argmax(-1) for part in slots.split(HEAD_ROWS)])
    return out.view(n - 1, cfg.block_size - 1).cpu()


def leading_matches(drafts: torch.Tensor, answer: list[int]) -> tuple[list[int], list[int], list[int]]:
    """``lead [n]`` from ``block_drafts``: ``lead[j]`` = how many drafts of the block at start ``j`` equal
    ``a_j, a_{j+1}, ...`` (at most ``B - 1``, never past the answer's end; ``lead[0]`` = 0: the prefill's
    token is no round); and ``hits``/``tried [B - 1]``: per slot ``k``, the starts whose drafts ``1..k``
    all matched / whose ``1..k-1`` did (and whose slot ``k`` is inside the answer)."""
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


def acceptance_figures(leads: list[list[int]], hits: list[int], tried: list[int]) -> dict[str, Any]:
    """Per-slot conditional acceptance (slot ``k`` accepted given slots ``< k`` were), acceptance length at K
    in ``LENGTHS`` below the block and at ``K = B - 1`` (mean tokens a round from any start yields, the
    verifier's included) and tokens per round for K = 1 .. B - 1 (``replay_leads``: rounds in sequence)."""
    width = len(hits)
    starts = [(lead, j) for lead in leads for j in range(1, len(lead))]
    length = {
        k: sum(min(lead[j], k, len(lead) - 1 - j) + 1 for lead, j in starts) / max(len(starts), 1)
        for k in sorted({k for k in LENGTHS if k < width} | {width})
    }
    return {
        "conditional_acceptance": [h / t if t else 0.0 for h, t in zip(hits, tried, strict=True)],
        "acceptance_length": length,
        "tokens_per_round": replay_leads(leads, width),
        "starts": len(starts),
        "answers": len(leads),
        "tokens": sum(len(lead) for lead in leads),
    }


def measure(
    draft: DFlashDraft,
    m: EarlyExitModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    eos: set[int],
) -> dict[str, Any]:
    """The figures of ``acceptance_figures`` for the target's greedy answers to ``prompts``."""
    width, feature_ids = draft.config.block_size - 1, draft.config.feature_ids
    leads, hits, tried = [], [0] * width, [0] * width
    was_training = draft.training
    draft.eval()
    try:
        for b in range(0, len(prompts), batch_size):
            records = generation_features(
                m,
                prompts[b : b + batch_size],
                feature_ids,
                1,
                torch.float32,
                max_new_tokens=max_new_tokens,
                eos=eos,
            )
            for record in records:
                if len(record["targets"]) < 2:
                    continue  # no round: the prefill's token ends the answer
                drafts = block_drafts(draft, m, record, feature_ids)
                lead, h, t = leading_matches(drafts, record["targets"].tolist())
                leads.append(lead)
                hits = [a + b for a, b in zip(hits, h, strict=True)]
                tried = [a + b for a, b in zip(tried, t, strict=True)]
    finally:
        draft.train(was_training)
    return acceptance_figures(leads, hits, tried)


def drafter_record(figures: dict[str, Any], measured_on: str) -> AcceptanceRecord:
    """``acceptance.json``'s content: one drafter ``dflash`` (its first slot's acceptance and tokens per round
    of the first K drafts of a block)."""
    first = figures["conditional_acceptance"][0] if figures["conditional_acceptance"] else 0.0
    drafter = DrafterRecord(drafter="dflash", acceptance=first, tokens_per_round=figures["tokens_per_round"])
    return AcceptanceRecord([drafter], measured_on, figures["tokens"])


def table_text(figures: dict[str, Any]) -> str:
    """The figures as a short table (logged at the end of a run)."""
    cond = figures["conditional_acceptance"]
    rounds = figures["tokens_per_round"]
    lines = [
        f"DFlash block drafting on {figures['answers']} held-out answers ({figures['starts']} starts):",
        "  slot k           " + " ".join(f"{k:>6d}" for k in range(1, len(cond) + 1)),
        "  acceptance      " + " ".join(f"{a:6.3f}" for a in cond),
        "  tokens/round K  " + " ".join(f"{rounds[k]:6.3f}" for k in sorted(rounds)),
        "  acceptance length "
        + ", ".join(f"K={k}: {v:.3f}" for k, v in figures["acceptance_length"].items()),
    ]
    return "\n".join(lines)
