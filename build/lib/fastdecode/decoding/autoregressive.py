"""Autoregressive decoding on the adapter and the explicit cache: the baseline the other strategies match.

With ``cfg.exit_layer = E`` this is pure early exit: every token (prompt included) runs only layers ``< E``
and the shared exit head. That is lossy, and the cache's layers ``>= E`` are never written, so such a cache
must not be reused by a full-depth decoder.
"""

from __future__ import annotations

import torch

from fastdecode.decoding.common import (
    DecodeConfig,
    DecodeOutput,
    Rows,
    check,
    choose,
    new_generator,
    prefill,
    probabilities,
    refuse_draft_model,
)
from fastdecode.model import EarlyExitModel


@torch.inference_mode()
def generate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """Decode ``prompts`` (batch of token-id lists) one token per model pass.

    Rows that finished (EOS or ``max_new_tokens``) keep running a pad token in a slot that no row may attend
    to, until every row has finished; their outputs are ignored.
    """
    check(cfg, m, prompts)
    refuse_draft_model("autoregressive", draft)
    depth = cfg.exit_layer or m.num_layers
    width = max(len(p) for p in prompts)
    state = prefill(m, prompts, width + cfg.max_new_tokens, exit_layer=depth)
    cache, positions, logits = state.cache, state.positions, state.logits
    generator = new_generator(cfg, m.device)
    rows = Rows(len(prompts), cfg)
    out = DecodeOutput(tokens=rows.tokens)
    while True:
        probs = None if cfg.greedy else probabilities(logits, cfg)
        tokens = choose(logits, probs, cfg, generator)  # [B]
        rows.emit_tokens(tokens)  # the one host sync per token: EOS decides the loop
        if not rows.active:
            return out
        active = rows.active_mask(m.device)  # [B] bool
        tokens = torch.where(active, tokens, torch.zeros_like(tokens))
        pos = positions[:, None]  # [B, 1]
        cache.reserve(active[:, None], cache.lengths[0], pos)  # finished rows write a slot no one attends to
        hidden = m.run_layers(m.embed(tokens[:, None], pos), 0, depth, pos, cache=cache)
        logits = m.exit_logits(hidden[:, -1])  # [B, V]
        positions = positions + active.long()  # finished rows stay put (their positions never overflow)
        out.steps += 1
        out.layers_run += depth * len(rows.active)
        out.layer_calls += depth
