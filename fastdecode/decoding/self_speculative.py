"""LayerSkip self-speculative decoding: draft with layers ``< E`` through the shared exit head, verify with
layers ``>= E`` on the stored exit hidden states, over ONE KV cache.

One round, with ``t`` the last accepted token (not yet in the cache) at position ``p``::

    draft:   t, d1, .., d_{k-1} through layers < E, one at a time -> exit hidden states h_0..h_{k-1}, drafts
             d1..dk from the exit head; then d_k through layers < E -> h_k (it was never fed back)
    verify:  layers >= E over [h_0..h_k] (k+1 positions) -> verifier logits at every draft position
    accept:  per row a_b drafts (greedy prefix match, or the lossless sampling rule), plus one token from
             the verifier (correction or bonus)

Each token passes each layer exactly once: the layer-``< E`` KV written while drafting is exactly what the
full model writes, so it is kept (rejected drafts pass every layer once too: verification needs them).
Rollback is a length pointer: crop every layer to the longest accepted length in the batch; rows that
accepted fewer leave holes (``key_valid`` False) that attention masks exactly, so greedy output is
bit-identical to ``autoregressive`` in fp32. Sliding windows count positions across holes (``KVCache.key_pos``).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    sample,
)
from fastdecode.decoding.policies import POLICIES, Constant, LaggedFlag
from fastdecode.model import EarlyExitModel


@dataclass
class Draft:
    hidden: torch.Tensor  # [B, k+1, H]: exit hidden states of [t, d1..dk] (inputs of layer E)
    tokens: torch.Tensor  # [B, k] drafted tokens
    probs: torch.Tensor | None  # [B, k, V] processed drafter probabilities (sampling only)


def _draft(
    m: EarlyExitModel,
    cache: KVCache,
    last: torch.Tensor,
    positions: torch.Tensor,
    active: torch.Tensor,
    limit: int,
    policy: Constant,
    flag: LaggedFlag,
    cfg: DecodeConfig,
    generator: torch.Generator,
) -> Draft:
    """Draft up to ``limit`` tokens after ``last [B]`` (at ``positions [B]``) with layers ``< E``."""
    max_position = m.config.max_position_embeddings - 1  # rows past their budget: positions never used
    hiddens, tokens, probs = [], [], []
    policy.begin()
    flag.reset()
    token = last
    for i in range(limit + 1):
        pos = (positions + i).clamp(max=max_position)[:, None]  # [B, 1]
        cache.reserve(active[:, None], cache.lengths[0], pos)  # finished rows: a slot nobody attends to
        hidden = m.run_layers(m.embed(token[:, None], pos), 0, cfg.exit_layer, pos, cache=cache)
        hiddens.append(hidden)
        # The flag about `token` (pushed last step) is read only now, after its pass was launched: no stall.
        if i == limit or not flag.read():
            break
        logits = m.exit_logits(hidden[:, -1])  # [B, V]
        q = probabilities(logits, cfg) if policy.dynamic or not cfg.greedy else None
        token = choose(logits, q, cfg, generator)
        tokens.append(token)
        if not cfg.greedy:
            probs.append(q)
        if policy.dynamic:
            flag.push(policy.keep_drafting(q.gather(-1, token[:, None])[:, 0], active))
    batch = last.shape[0]
    drafted = torch.stack(tokens, 1) if tokens else last.new_zeros(batch, 0)
    q_all = None
    if not cfg.greedy:
        q_all = torch.stack(probs, 1) if probs else torch.zeros(batch, 0, m.vocab_size, device=m.device)
    return Draft(torch.cat(hiddens, 1), drafted, q_all)


def _accept(
    logits: torch.Tensor, draft: Draft, cfg: DecodeConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verifier ``logits [B, k+1, V]`` -> (accepted drafts [B], next token [B], oracle draft length [B])."""
    k = draft.tokens.shape[1]
    target = logits.argmax(-1)  # [B, k+1]
    oracle = (draft.tokens == target[:, :k]).long().cumprod(-1).sum(-1)
    if cfg.greedy:
        return oracle, target.gather(1, oracle[:, None])[:, 0], oracle
    p = probabilities(logits, cfg)  # [B, k+1, V]
    # q after the last draft is 0, so the "residual" there is p itself: the bonus token when all are accepted.
    q = torch.cat([draft.probs, torch.zeros_like(p[:, :1])], 1)
    p_draft = p[:, :k].gather(-1, draft.tokens[..., None])[..., 0]  # [B, k]
    q_draft = q[:, :k].gather(-1, draft.tokens[..., None])[..., 0]
    r = torch.rand(p_draft.shape, generator=generator, device=p.device)
    # Accept iff r < p/q (strict: a token the verifier gives probability 0 is never accepted).
    accepted = (r * q_draft < p_draft).long().cumprod(-1).sum(-1)
    at = accepted[:, None, None].expand(-1, 1, p.shape[-1])
    p_at, q_at = p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]  # [B, V]
    residual = (p_at - q_at).clamp_min(0)
    # p == q leaves no residual mass; a rejection then had probability 0, so any valid fallback is exact.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return accepted, sample(residual, generator), oracle


def _rollback(cache: KVCache, start: int, accepted: torch.Tensor, longest: int) -> None:
    """Keep slots ``[start, start + longest]`` (t plus the longest accepted run); rows that accepted fewer
    drafts get their rejected slots masked (holes)."""
    cache.crop(start + longest + 1)
    offsets = torch.arange(longest + 1, device=accepted.device)  # [longest + 1]
    keep = offsets[None, :] <= accepted[:, None]  # [B, longest + 1]
    cache.key_valid[:, start : start + longest + 1] &= keep


@torch.inference_mode()
def generate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """Self-speculative decoding of ``prompts`` with the drafter = layers ``< cfg.exit_layer``; lossless."""
    check(cfg, m, prompts)
    refuse_draft_model("self_speculative", draft)
    if cfg.exit_layer is None:
        raise ConfigError(
            f"decoder 'self_speculative' needs decoder.exit_layer (the drafter's depth), "
            f"1 <= exit_layer <= {m.num_layers - 1}."
        )
    exit_layer, num_layers = cfg.exit_layer, m.num_layers
    width = max(len(p) for p in prompts)
    state = prefill(m, prompts, width + cfg.max_new_tokens + cfg.draft_tokens + 1)
    cache, positions = state.cache, state.positions
    policy = POLICIES[cfg.policy](cfg.draft_tokens, cfg.confidence_threshold, exit_layer / num_layers)
    flag = LaggedFlag(m.device)
    generator = new_generator(cfg, m.device)
    rows = Rows(len(prompts), cfg)
    out = DecodeOutput(tokens=rows.tokens)
    last = choose(state.logits, None, cfg, generator)  # the first new token comes from the full prefill
    for row, token in enumerate(last.tolist()):
        rows.emit(row, [token])
    while rows.active:
        live = rows.active
        active = rows.active_mask(m.device)
        limit = min(policy.draft_limit(), rows.most_remaining() - 1)  # the verifier adds one token itself
        start = cache.lengths[0]
        drafted = _draft(m, cache, last, positions, active, limit, policy, flag, cfg, generator)
        k = drafted.tokens.shape[1]
        pos = (positions[:, None] + torch.arange(k + 1, device=m.device)).clamp(
            max=m.config.max_position_embeddings - 1
        )
        hidden = m.run_layers(drafted.hidden, exit_layer, num_layers, pos, cache=cache)
        accepted, last, oracle = _accept(m.exit_logits(hidden), drafted, cfg, generator)
        # The one host sync per round: emitted tokens decide EOS, budgets and the rollback length.
        host = torch.cat([drafted.tokens, last[:, None], accepted[:, None], oracle[:, None]], 1).tolist()
        per_row: list[int | None] = [None] * len(prompts)  # accepted drafts of the rows decoding this round
        kept = [0] * len(prompts)  # drafts whose slots stay valid: accepted, cut at EOS / the budget
        for row in live:
            per_row[row] = a = host[row][k + 1]
            kept[row] = rows.emit(row, host[row][:a] + [host[row][k]]) - 1
        kept_t = torch.tensor(kept, device=m.device)
        _rollback(cache, start, kept_t, max(kept))
        positions = positions + (kept_t + 1) * active
        out.record([per_row[row] for row in live], k, [host[row][k + 2] for row in live])
        policy.update(per_row, k)
        out.steps += 1
        out.layers_run += (k + 1) * num_layers * len(live)
        out.layer_calls += (k + 1) * exit_layer + num_layers - exit_layer
    return out
