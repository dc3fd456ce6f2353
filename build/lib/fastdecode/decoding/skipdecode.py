"""SkipDecode decoding: one dense, shrinking set of layers per step for the whole batch, KV-cached.

Step ``k`` (the k-th new token of every row) runs the warm-up layers ``[0, w)`` and the top layers
``[L-(b(k)-w), L)`` of the policy in ``fastdecode/skipdecode.py``; the prompt is prefilled at full depth.

Why the cache stays complete without recomputation: the adapter puts the queries of a ``run_layers`` call at
slot ``cache.lengths[start]``. Layer 0 (when ``w > 0``) and every top layer that runs at step ``k`` also ran
at every earlier step (the budget never increases), so their lengths all equal the current slot and their
caches hold every earlier token. A layer skipped at step ``k`` is never run again, so its shorter cache is
never read. The slot of the step is taken from the last layer, which every step runs.
"""

from __future__ import annotations

import torch

from fastdecode.cache import KVCache
from fastdecode.config import ConfigError
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
from fastdecode.skipdecode import SkipDecodePolicy


def policy_from_config(cfg: DecodeConfig, num_layers: int, prompt_len: int) -> SkipDecodePolicy:
    """The policy of ``cfg``'s ``skip_*`` fields for a model of ``num_layers`` and a batch whose longest
    prompt has ``prompt_len`` tokens; every value is checked here, before any model work."""
    max_budget = num_layers if cfg.skip_max_budget is None else cfg.skip_max_budget
    policy = SkipDecodePolicy(
        num_layers=num_layers,
        max_budget=max_budget,
        min_budget=max_budget if cfg.skip_min_budget is None else cfg.skip_min_budget,
        warmup_layers=cfg.skip_warmup_layers,
        max_length=prompt_len + cfg.max_new_tokens if cfg.skip_max_length is None else cfg.skip_max_length,
        keys="decoder.skip_",
    )
    policy.check_prompt(prompt_len)
    return policy


def step(
    m: EarlyExitModel,
    policy: SkipDecodePolicy,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    budget: int,
) -> torch.Tensor:
    """Decode one token per row: ``tokens``, ``positions``, ``valid`` are ``[B]``; returns logits ``[B, V]``.

    ``valid`` False gives the token a slot no row attends to (a finished row's filler).
    """
    pos = positions[:, None]  # [B, 1]
    cache.reserve(valid[:, None], cache.lengths[policy.num_layers - 1], pos)
    hidden = m.embed(tokens[:, None], pos)  # [B, 1, H]
    for layers in policy.layer_ranges(budget):
        hidden = m.run_layers(hidden, layers.start, layers.stop, pos, cache=cache)
    return m.exit_logits(hidden[:, -1])


@torch.inference_mode()
def generate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """Decode ``prompts`` (batch of token-id lists) one token per step under the SkipDecode policy.

    ``layers_run`` counts decoder-layer x token applications of active rows after the prefill (the budget
    per token); ``layer_calls`` the budget per step. Finished rows run a filler as in autoregressive.
    """
    check(cfg, m, prompts)
    refuse_draft_model("skipdecode", draft)
    if cfg.exit_layer is not None:
        raise ConfigError(
            f"decoder.exit_layer={cfg.exit_layer}: skipdecode always ends at the last layer (its budgets "
            "come from decoder.skip_*); set exit_layer=null."
        )
    width = max(len(p) for p in prompts)
    policy = policy_from_config(cfg, m.num_layers, width)
    budgets = policy.response_budgets(cfg.max_new_tokens, width).tolist()  # one per step, whole batch
    state = prefill(m, prompts, width + cfg.max_new_tokens)
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
        budget = budgets[out.steps]
        logits = step(m, policy, cache, tokens, positions, active, budget)
        positions = positions + active.long()  # finished rows stay put
        out.steps += 1
        out.layers_run += budget * len(rows.active)
        out.layer_calls += budget
