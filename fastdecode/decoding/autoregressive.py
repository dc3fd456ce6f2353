"""Autoregressive decoding on the model and the explicit cache: the baseline the other strategies match.

With ``cfg.exit_layer = E`` this is pure early exit: every token (prompt included) runs only layers ``< E``
and the shared exit head. That is lossy, and the cache's layers ``>= E`` are never written, so such a cache
must not be reused by a full-depth decoder.

The one-token-per-step loop (``decode_steps``) takes the layers to run at each step as a schedule, so
``skipdecode`` (a shrinking layer set per step) is this same loop with another schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastdecode.decoding.common import (
    Rows,
    check,
    choose,
    configure_engine,
    new_generator,
    prefill,
    probabilities,
    refuse_draft_model,
)
from fastdecode.decoding.config import DecodeConfig, DecodeOutput
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.model import EarlyExitModel

LayerRanges = Sequence[range]  # the layers one step runs: ascending, disjoint ranges of layer indices


def step(
    m: EarlyExitModel,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    *,
    layers: LayerRanges,
) -> torch.Tensor:
    """Decode one token per row through ``layers``: ``tokens``, ``positions``, ``valid`` are ``[B]``;
    returns logits ``[B, V]``. ``valid`` False gives the token a slot no row attends to (a finished row's
    filler).

    The token's slot is the cache length of the last layer the step runs: a schedule may skip a layer only
    if it never runs it again (as SkipDecode's non-increasing budget does), so every layer that runs holds
    every earlier slot and all their lengths agree.
    """
    pos = positions[:, None]  # [B, 1]
    cache.reserve(valid[:, None], cache.lengths[layers[-1].stop - 1], pos)
    hidden = m.embed(tokens[:, None], pos)  # [B, 1, H]
    for run in layers:
        hidden = m.run_layers(hidden, run.start, run.stop, pos, cache=cache)
    return m.exit_logits(hidden[:, -1])


def decode_steps(
    m: EarlyExitModel,
    prompts: list[list[int]],
    cfg: DecodeConfig,
    *,
    schedule: Sequence[LayerRanges],
    prefill_depth: int,
) -> DecodeOutput:
    """Prefill ``prompts`` through layers ``[0, prefill_depth)``, then feed back one token per row and step,
    step ``k`` running the layers ``schedule[k]`` (at least ``max_new_tokens - 1`` entries: the first new
    token comes from the prefill, the last is emitted without being fed back).

    Rows that finished (EOS or ``max_new_tokens``) keep running a pad token in a slot that no row may attend
    to, until every row has finished; their outputs are ignored. ``layers_run`` counts layer x token
    applications of active rows, ``layer_calls`` the layers per step.
    """
    width = max(len(p) for p in prompts)
    state = prefill(m, prompts, width + cfg.max_new_tokens, exit_layer=prefill_depth)
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
        layers = schedule[out.steps]
        logits = step(m, cache, tokens, positions, active, layers=layers)
        positions = positions + active.long()  # finished rows stay put (their positions never overflow)
        depth = sum(len(run) for run in layers)
        out.steps += 1
        out.layers_run += depth * len(rows.active)
        out.layer_calls += depth


@torch.inference_mode()
def generate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """Decode ``prompts`` (batch of token-id lists) one token per pass through layers ``[0, E)`` (all
    layers when ``cfg.exit_layer`` is None)."""
    check(cfg, m, prompts)
    refuse_draft_model("autoregressive", draft)
    configure_engine(m, cfg)  # the execution engine this call decodes on (the checks above change nothing)
    depth = cfg.exit_layer or m.num_layers
    schedule = [[range(depth)]] * cfg.max_new_tokens
    return decode_steps(m, prompts, cfg, schedule=schedule, prefill_depth=depth)
