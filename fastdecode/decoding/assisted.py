"""Two-model speculative decoding (Leviathan et al. 2023; HF's ``assistant_model``): a separate, smaller
draft model with the same tokenizer drafts, the target verifies; lossless (greedy and sampling).

One round, with ``t`` the last accepted token (in neither cache yet) at position ``p``::

    draft:   t, d1, .., d_{k-1} through the whole draft model, one at a time -> d1..dk; then d_k through it
    verify:  the whole target over [t, d1..dk] (k+1 positions) -> target logits at every draft position
    accept:  per row a_b drafts plus one target token (correction or bonus), as in ``self_speculative``

Each model keeps its own KV cache, and both caches keep the same slot layout: every round writes k+1 slots
into each ([t, d1..dk]) and the same rollback (crop by the length pointer, holes for rows that accepted
fewer) is applied to both. So the drafter's cache holds exactly the accepted tokens, like the target's:
d_k passes the drafter even though its logits are not needed, because when the whole draft is accepted the
next draft must attend to it; the verifier's own token (``t`` of the next round) enters both caches at the
start of that round. Drafting d_k costs one drafter pass per round (HF instead re-feeds it next round), and
dynamic policies need that pass anyway to read their stop flag without a host sync (``LaggedFlag``).

Batches of any size decode with ragged acceptance (HF refuses batch > 1). The draft-length policies get the
cost ratio c = drafter step / target step, from the weights each reads per token (``step_cost``; a draft
vocabulary shrinks the drafter's head).
"""

from __future__ import annotations

import torch

from fastdecode.cache import KVCache
from fastdecode.config import ConfigError
from fastdecode.decoding import speculative
from fastdecode.decoding.common import (
    DecodeConfig,
    DecodeOutput,
    Rows,
    check,
    choose,
    configure_engine,
    new_generator,
    prefill,
)
from fastdecode.decoding.draft_vocab import draft_vocab_ids
from fastdecode.model import EarlyExitModel


def check_draft(
    m: EarlyExitModel, draft: EarlyExitModel | None, cfg: DecodeConfig, prompts: list[list[int]]
) -> None:
    """Refuse a missing or incompatible draft model (and an exit layer) before any work is done."""
    if draft is None:
        raise ConfigError(
            "decoder 'assisted' needs a draft model: pass draft=<EarlyExitModel> (a smaller model with the "
            "target's tokenizer), or use 'self_speculative' to draft with the target's own first layers."
        )
    if cfg.exit_layer is not None:
        raise ConfigError(
            f"decoder 'assisted' drafts with the whole draft model and verifies with the whole target, so "
            f"decoder.exit_layer={cfg.exit_layer} has no meaning here; set decoder.exit_layer=null (or use "
            "'self_speculative' to draft with the target's first exit_layer layers)."
        )
    if draft.vocab_size != m.vocab_size:
        raise ConfigError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens but the target's has {m.vocab_size}: "
            "drafted ids would mean different tokens; use a draft model with the same tokenizer."
        )
    if draft.device != m.device:
        raise ConfigError(
            f"the draft model is on {draft.device} but the target on {m.device}; load both on one device."
        )
    context = draft.config.max_position_embeddings
    longest = max((len(p) for p in prompts), default=0)
    if longest + cfg.max_new_tokens > context:
        raise ConfigError(
            f"the longest prompt has {longest} tokens but the draft model's context (max_position_embeddings) "
            f"is {context} and max_new_tokens={cfg.max_new_tokens}: prompts may have at most "
            f"{context - cfg.max_new_tokens} tokens; shorten the prompt or lower max_new_tokens."
        )


def _verify(
    m: EarlyExitModel,
    cache: KVCache,
    last: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    active: torch.Tensor,
) -> torch.Tensor:
    """Target logits ``[B, k+1, V]`` of ``[last [B], tokens [B, k]]`` at ``positions [B]`` onwards; the k+1
    slots are valid only for the ``active [B]`` rows (finished rows write slots nobody attends to)."""
    ids = torch.cat([last[:, None], tokens], 1)  # [B, k+1]
    offsets = torch.arange(ids.shape[1], device=m.device)
    pos = (positions[:, None] + offsets).clamp(max=m.config.max_position_embeddings - 1)
    cache.reserve(active[:, None].expand_as(ids), cache.lengths[0], pos)
    hidden = m.run_layers(m.embed(ids, pos), 0, m.num_layers, pos, cache=cache)
    return m.exit_logits(hidden)


@torch.inference_mode()
def generate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """Speculative decoding of ``prompts`` on the target ``m``, drafting with the separate model ``draft``."""
    check_draft(m, draft, cfg, prompts)
    check(cfg, m, prompts)
    configure_engine(draft, cfg)
    # None unless decoder.draft_vocab names a subset for the draft head
    vocab = draft_vocab_ids(cfg.draft_vocab, draft)
    capacity = max(len(p) for p in prompts) + cfg.max_new_tokens + cfg.draft_tokens + 1
    state, draft_state = prefill(m, prompts, capacity), prefill(draft, prompts, capacity)
    caches, positions = [state.cache, draft_state.cache], state.positions
    head_rows = None if vocab is None else len(vocab)
    cost_ratio = draft.step_cost(head_rows=head_rows) / m.step_cost()
    policy = speculative.new_policy(cfg, cost_ratio=cost_ratio)
    generator = new_generator(cfg, m.device)
    drafter = speculative.Drafter(
        draft,
        draft.num_layers,
        cache=draft_state.cache,
        policy=policy,
        cfg=cfg,
        generator=generator,
        vocab=vocab,
    )
    rows = Rows(len(prompts), cfg)
    out = DecodeOutput(tokens=rows.tokens)
    last = choose(state.logits, None, cfg, generator)  # the first new token comes from the target's prefill
    rows.emit_tokens(last)
    while rows.active:
        live = len(rows.active)
        active = rows.active_mask(m.device)
        limit = min(policy.draft_limit(), rows.most_remaining() - 1)  # the verifier adds one token itself
        start = state.cache.lengths[0]  # == draft_state.cache.lengths[0]: both caches share the slot layout
        drafted = drafter.draft(last, positions, active, limit)
        k = drafted.tokens.shape[1]
        logits = _verify(m, state.cache, last, drafted.tokens, positions, active)
        verdict = speculative.accept(logits, drafted, cfg, generator=generator)
        last = verdict.next_token
        kept = speculative.settle(
            rows, out, policy=policy, draft=drafted, verdict=verdict, caches=caches, start=start
        )
        positions = positions + (kept + 1) * active
        # Layer applications and sequential layer calls of both models (the drafter's are usually cheaper).
        out.layers_run += (k + 1) * (draft.num_layers + m.num_layers) * live
        out.layer_calls += (k + 1) * draft.num_layers + m.num_layers
    return out
