"""What a trained DFlash drafter accepts (``fastdecode.training.drafter_report``, recorded as drafter
``dflash``): ``block_drafts`` drafts the block at every anchor of an answer in one forward (``block_mask``),
each from the features of the tokens before its anchor, exactly the block greedy decoding drafts there.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_train.losses import block_inputs
from fastdecode.drafters.dflash.layer import DFlashDraft, block_mask
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training import drafter_report

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


def measure(
    draft: DFlashDraft,
    m: EarlyExitModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    eos: set[int],
) -> dict[str, Any]:
    """Per-slot acceptance, acceptance length at ``LENGTHS`` below the block and at ``K = B - 1``, tokens per
    round for K = 1 .. B - 1 (``fastdecode.training.drafter_report``) on the target's greedy answers."""
    width, feature_ids = draft.config.block_size - 1, draft.config.feature_ids
    return drafter_report.measure(
        draft,
        m,
        prompts,
        feature_ids,
        lambda record: block_drafts(draft, m, record, feature_ids),
        width=width,
        lengths=sorted({k for k in LENGTHS if k < width} | {width}),
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        eos=eos,
    )
