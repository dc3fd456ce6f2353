"""The one speculative loop: a proposer drafts, the target verifies, the rows settle, every cache rolls back.

Every draft-then-verify decoder is ``speculate`` over a ``Proposer`` (``proposers.py``; the drafters live in
``fastdecode.drafters``). This module owns a round's records (``Round``, ``Draft``, ``Verdict``, ``Settled``),
the verification pass (``verify``, which captures feature layers with ``run_capturing``), the lossless
acceptance rule (``accept``, and ``rule`` for token trees with ``tree.py``), and ``settle`` and ``rollback``
of every cache. Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from fastdecode.decoding import tree
from fastdecode.decoding.common import Prefill, Rows, choose, left_pad, probabilities, sample
from fastdecode.decoding.config import DecodeConfig, DecodeOutput
from fastdecode.decoding.policies import POLICIES, DraftPolicy
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.model import EarlyExitModel


@dataclass
class Round:
    """What a proposer sees when a round begins (all tensors on the model's device)."""

    last: torch.Tensor  # [B] the last accepted token t, in no cache yet
    positions: torch.Tensor  # [B] its position
    active: torch.Tensor  # [B] bool: rows still decoding
    limit: int  # the most tokens a draft may have this round (policy, budgets)
    rows: Rows  # every row's emitted tokens so far (host lists)
    start: int  # the target cache slot t goes into


@dataclass
class Draft:
    """What a proposer produced in one round, for the verifier to rule on (``accept``)."""

    tokens: torch.Tensor  # [B, k] drafted tokens (full-vocabulary ids); padding after a row's length
    probs: torch.Tensor | None = None  # [B, k, V] the distributions they were drawn from (sampling only)
    lengths: list[int] | None = None  # tokens drafted per row (<= k); None: k for every row
    hidden: torch.Tensor | None = None  # [B, k+1, H] target residual stream after ``depth`` blocks at [t, d]
    depth: int = 0  # target blocks already run on [t, d1..dk] into the target's cache (0: none)
    sources: list[str] | None = None  # per row, the proposer that drafted it (a chain's statistics)
    layers_run: int = 0  # drafting work: decoder-layer x token applications of the active rows
    layer_calls: int = 0  # drafting's sequential decoder-layer calls
    # [B, k+1, F*H]: the target's hidden states at the proposer's ``feature_layers`` at [t, d], concatenated
    # in that order; filled by ``verify`` for a proposer that names feature layers (EAGLE-3), else None
    features: torch.Tensor | None = None
    # [B, k] a token tree: each draft's parent among the k drafts (-1: the last accepted token t); a parent
    # comes before its children, siblings carry distinct tokens; padding after a row's length hangs off t.
    # None: a chain (draft j's parent is j - 1). Trees are deterministic drafts (``probs`` None or one-hot).
    parents: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    def row_lengths(self) -> list[int]:
        return self.lengths if self.lengths is not None else [self.k] * self.tokens.shape[0]


class Verdict(NamedTuple):
    """The verifier's ruling on one round (``accept``), one entry per row: all ``[B]`` long."""

    accepted: torch.Tensor  # leading drafts accepted (greedy: prefix match; sampling: the lossless rule)
    next_token: torch.Tensor  # the verifier's own token after them (correction, or bonus if all accepted)
    oracle: torch.Tensor  # leading drafts equal to the verifier's argmax (the best greedy draft length)
    target: torch.Tensor  # [B, k+1] the verifier's argmax at every position (Jacobi pools harvest it)


def new_policy(cfg: DecodeConfig, marginal: list[float]) -> DraftPolicy:
    """The draft-length policy ``cfg.policy`` with K = ``cfg.draft_tokens``; ``marginal[j]``: what the
    (j+1)-th drafted token adds to a round's cost (``adaptive`` weighs a further token against it)."""
    return POLICIES[cfg.policy](cfg.draft_tokens, threshold=cfg.confidence_threshold, marginal=marginal)


def _valid(draft: Draft, device: torch.device) -> torch.Tensor:
    """[B, k] bool: the draft positions each row really drafted."""
    lengths = torch.tensor(draft.row_lengths(), device=device)
    return torch.arange(draft.k, device=device)[None, :] < lengths[:, None]


def accept(logits: torch.Tensor, draft: Draft, cfg: DecodeConfig, *, generator: torch.Generator) -> Verdict:
    """Rule on ``draft`` from the verifier's ``logits [B, k+1, V]`` at ``[t, d1..dk]``; ``generator`` draws
    the acceptance tests and the residual token when sampling. Padding after a row's length is never
    accepted; the token after a fully accepted draft is the bonus drawn from p there."""
    k = draft.k
    target = logits.argmax(-1)  # [B, k+1]
    if k == 0 and cfg.greedy:  # nothing drafted: a plain decoding step
        none = torch.zeros_like(target[:, 0])
        return Verdict(accepted=none, next_token=target[:, 0], oracle=none, target=target)
    valid = _valid(draft, logits.device)
    oracle = ((draft.tokens == target[:, :k]) & valid).long().cumprod(-1).sum(-1)
    if cfg.greedy:
        next_token = target.gather(1, oracle[:, None])[:, 0]
        return Verdict(accepted=oracle, next_token=next_token, oracle=oracle, target=target)
    p = probabilities(logits, cfg)  # [B, k+1, V]
    # q is 0 after each row's last draft, so the "residual" there is p itself: the bonus token.
    q = torch.cat([draft.probs * valid[..., None], torch.zeros_like(p[:, :1])], 1)
    p_draft = p[:, :k].gather(-1, draft.tokens[..., None])[..., 0]  # [B, k]
    q_draft = q[:, :k].gather(-1, draft.tokens[..., None])[..., 0]
    r = torch.rand(p_draft.shape, generator=generator, device=p.device)
    # Accept iff r < p/q (strict: a token the verifier gives probability 0 is never accepted).
    accepted = ((r * q_draft < p_draft) & valid).long().cumprod(-1).sum(-1)
    at = accepted[:, None, None].expand(-1, 1, p.shape[-1])
    p_at, q_at = p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]  # [B, V]
    residual = (p_at - q_at).clamp_min(0)
    # p == q leaves no residual mass; a rejection then had probability 0, so any valid fallback is exact.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return Verdict(accepted, sample(residual, generator), oracle, target)


def rule(
    logits: torch.Tensor,
    draft: Draft,
    cfg: DecodeConfig,
    *,
    generator: torch.Generator,
    caches: list[KVCache],
    start: int,
) -> tuple[Verdict, Draft]:
    """``accept`` for a chain; for a token tree (``draft.parents``) the branch rule of ``tree.py`` (greedy:
    the longest branch the target agrees with; sampling: multi-candidate speculative sampling), then the
    accepted branch moved into the slots after t (``start``) of every cache in ``caches`` and returned as a
    linearised draft (its tokens first, ``lengths`` still the nodes drafted): ``settle`` and ``rollback``
    then treat it as a chain whose first ``accepted`` drafts were taken. Only the longest branch's slots move
    (the rest are rolled back), and nothing moves when every row's branch is already in place."""
    if draft.parents is None:
        return accept(logits, draft, cfg, generator=generator), draft
    tokens, parents, valid = draft.tokens, draft.parents, _valid(draft, logits.device)
    target = logits.argmax(-1)  # [B, k+1]
    best = tree.greedy_walk(tokens, parents, valid, target)
    if cfg.greedy:
        node, next_token = best, target.gather(1, (best + 1)[:, None])[:, 0]
    else:
        if draft.probs is not None and not bool(
            (draft.probs.gather(-1, tokens[..., None]) == 1)[valid].all()
        ):
            raise ValueError("a token tree's drafts must be deterministic (Draft.probs one-hot or None)")
        uniforms = torch.rand(tokens.shape, generator=generator, device=logits.device)
        node, residual = tree.sample_walk(tokens, parents, valid, probabilities(logits, cfg), uniforms)
        next_token = sample(residual, generator)
    order = tree.path_order(parents, node)  # [B, k]
    accepted = tree.node_depth(parents, node)
    oracle = accepted if cfg.greedy else tree.node_depth(parents, best)
    moved = int(accepted.max())  # slots past the longest branch are rolled back: nothing to move there
    if not bool((order[:, :moved] == torch.arange(moved, device=order.device)).all()):
        for cache in caches:
            cache.reorder(start + 1, order[:, :moved])
    where = torch.cat([order.new_zeros(order.shape[0], 1), order + 1], 1)  # [B, k+1]: t, then the nodes
    verdict = Verdict(accepted, next_token, oracle, target.gather(1, where))
    probs = None if draft.probs is None else draft.probs.gather(1, order[..., None].expand_as(draft.probs))
    features = draft.features
    if features is not None:
        features = features.gather(1, where[..., None].expand_as(features))
    return verdict, replace(
        draft, tokens=tokens.gather(1, order), probs=probs, features=features, parents=None
    )


def rollback(
    cache: KVCache, start: int, *, accepted: torch.Tensor, longest: int, ragged: bool = True
) -> None:
    """Keep slots ``[start, start + longest]`` (t plus the longest accepted run); rows that accepted fewer
    drafts (``accepted [B]``, at most ``longest``) get their rejected slots masked (holes). ``ragged=False``:
    every row kept ``longest``, so there is nothing to mask."""
    cache.crop(start + longest + 1)
    if not ragged:
        return
    offsets = torch.arange(longest + 1, device=accepted.device)  # [longest + 1]
    keep = offsets[None, :] <= accepted[:, None]  # [B, longest + 1]
    cache.key_valid[:, start : start + longest + 1] &= keep


@dataclass
class Settled:
    """A round's outcome per row (host lists; None for rows that no longer decode)."""

    accepted: list[int | None]  # drafts accepted
    kept: list[int]  # drafts whose slots stay valid (accepted, cut at EOS / the budget; 0 when not decoding)
    lengths: list[int | None]  # drafts proposed
    sources: list[str | None] = field(default_factory=list)


def settle(
    rows: Rows, out: DecodeOutput, *, draft: Draft, verdict: Verdict, caches: list[KVCache], start: int
):
    """End a round that began at slot ``start``: emit each decoding row's accepted drafts and verifier token,
    roll every cache back to the same length, book the statistics. Returns ``(Settled, kept [B] tensor)``."""
    live, k, batch = rows.active, draft.k, len(rows.tokens)
    # The one host sync per round: emitted tokens decide EOS, budgets and the rollback length.
    host = torch.cat(
        [draft.tokens, verdict.next_token[:, None], verdict.accepted[:, None], verdict.oracle[:, None]], 1
    )
    host = host.tolist()
    lengths = draft.row_lengths()
    done = Settled([None] * batch, [0] * batch, [None] * batch, [None] * batch)
    for row in live:
        done.accepted[row] = a = host[row][k + 1]
        done.lengths[row] = lengths[row]
        done.sources[row] = draft.sources[row] if draft.sources else None
        done.kept[row] = rows.emit(row, host[row][:a] + [host[row][k]]) - 1
    kept_t = torch.tensor(done.kept, device=verdict.accepted.device)
    longest = max(done.kept)
    ragged = any(done.kept[row] != longest for row in range(batch))
    for cache in caches:
        rollback(cache, start, accepted=kept_t, longest=longest, ragged=ragged)
    out.record(
        [done.accepted[row] for row in live],
        [lengths[row] for row in live],
        [host[row][k + 2] for row in live],
        sources=[done.sources[row] for row in live] if draft.sources else None,
    )
    out.steps += 1
    return done, kept_t


def run_capturing(
    m: EarlyExitModel,
    hidden: torch.Tensor,
    depth: int,
    pos: torch.Tensor,
    cache: KVCache,
    *,
    layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Layers ``[depth, L)`` on ``hidden [B, T, H]`` -> ``(final residual stream [B, T, H], features)``:
    ``features [B, T, F*H]`` the residual stream after ``i`` blocks (Hugging Face's ``hidden_states[i]``;
    ``i = L``: after the final norm) for each ``i`` of ``layers``, concatenated in that order; None without
    ``layers``. The layers run in segments between those ids on the one cache: no extra pass."""
    if not layers:
        return m.run_layers(hidden, depth, m.num_layers, pos, cache=cache), None
    if min(layers) < depth:
        raise ValueError(f"feature layers {layers} lie below the {depth} blocks the drafter already ran")
    seen = {}
    for stop in sorted(set(layers)):
        hidden = m.run_layers(hidden, depth, stop, pos, cache=cache)
        seen[stop] = m.exit_hidden(hidden) if stop == m.num_layers else hidden
        depth = stop
    hidden = m.run_layers(hidden, depth, m.num_layers, pos, cache=cache)
    return hidden, torch.cat([seen[i] for i in layers], -1)


def verify(
    m: EarlyExitModel,
    cache: KVCache,
    r: Round,
    draft: Draft,
    features: tuple[int, ...] = (),
    *,
    run: int = 0,
) -> torch.Tensor:
    """Target logits ``[B, k+1, V]`` at ``[t, d1..dk]``: layers ``[draft.depth, L)`` on the hidden states the
    proposer hands over, or (``draft.hidden`` None) every layer from the embeddings; the k+1 slots are valid
    only for the active rows (finished rows write slots nobody attends to). ``features``: the hidden-state
    ids the proposer reads (``Proposer.feature_layers``), captured into ``draft.features`` on the way.
    ``run``: the positions the forward runs from the embeddings when more than k+1 (``CostModel.run_length``):
    copies of the last draft fill the rest, after the real positions (causal: they change nothing before
    them), their outputs dropped and their slots beyond what ``rollback`` keeps. A token tree
    (``draft.parents``): each position at t's position plus its depth, attending only to its ancestors (the
    cache's block mask while the layers run; padding hangs off t, attended by no draft)."""
    k = draft.k
    hidden, depth = draft.hidden, draft.depth
    if draft.parents is not None and (depth > 0 or hidden is not None):
        raise ValueError(
            f"a token tree (Draft.parents) whose drafting already ran {depth} target layers on it: not "
            "supported (those layers attended causally, not to each node's ancestors); draft a chain, or "
            "hand the tree over with depth 0 and no hidden states"
        )
    width = max(run, k + 1) if hidden is None else k + 1
    steps = torch.arange(width, device=m.device)
    if draft.parents is not None:  # a node sits at t's position plus its depth
        steps = tree.position_depths(draft.parents, width)
        cache.block = (r.start, tree.ancestor_mask(draft.parents, width))
    pos = (r.positions[:, None] + steps).clamp(max=m.config.max_position_embeddings - 1)
    try:
        if hidden is None:
            ids = torch.cat([r.last[:, None], draft.tokens], 1)  # [B, k+1]
            ids = torch.cat([ids, ids[:, -1:].expand(-1, width - k - 1)], 1)  # [B, width]
            cache.reserve(r.active[:, None].expand_as(ids), r.start, pos)
            hidden, depth = m.embed(ids, pos), 0
        hidden, found = run_capturing(m, hidden, depth, pos, cache, layers=features)
    finally:
        cache.block = None
    draft.features = None if found is None else found[:, : k + 1]
    return m.exit_logits(hidden)[:, : k + 1]


def speculate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, proposer, *, generator
) -> DecodeOutput:
    """Decode ``prompts`` on the target ``m`` with drafts from ``proposer`` (a ``Proposer``); lossless.

    The proposer prefills (its own caches too), then every round: draft, verify, accept, settle. ``steps``
    counts rounds; ``layers_run``/``layer_calls`` count the drafting and the verification.
    """
    widest = cfg.draft_tokens + 1  # a verification's positions, padded as ``verify``'s ``run`` may be
    if proposer.costs is not None:
        widest = max(proposer.costs.run_length(t) for t in range(1, widest + 1))
    capacity = max(len(p) for p in prompts) + cfg.max_new_tokens + widest
    state: Prefill = proposer.start(m, prompts, capacity)
    cache, positions = state.cache, state.positions
    policy = new_policy(cfg, proposer.marginal_costs(cfg.draft_tokens))
    proposer.policy = policy
    rows = Rows(len(prompts), cfg)
    out = DecodeOutput(tokens=rows.tokens)
    last = choose(state.logits, None, cfg, generator)  # the first new token comes from the target's prefill
    rows.emit_tokens(last)
    while rows.active:
        live = len(rows.active)
        limit = min(policy.draft_limit(), rows.most_remaining() - 1)  # the verifier adds one token itself
        r = Round(last, positions, rows.active_mask(m.device), limit, rows, cache.lengths[0])
        policy.begin()
        draft = proposer.propose(r)
        run = proposer.costs.run_length(draft.k + 1) if proposer.costs is not None else 0
        logits = verify(m, cache, r, draft, proposer.feature_layers, run=run)
        caches = [cache, *proposer.caches()]
        verdict, draft = rule(logits, draft, cfg, generator=generator, caches=caches, start=r.start)
        done, kept = settle(rows, out, draft=draft, verdict=verdict, caches=caches, start=r.start)
        policy.update(*proposer.feedback(done))
        proposer.update(r, draft, verdict, done)
        last, positions = verdict.next_token, positions + (kept + 1) * r.active
        out.layers_run += draft.layers_run + (draft.k + 1) * (m.num_layers - draft.depth) * live
        out.layer_calls += draft.layer_calls + m.num_layers - draft.depth
    return out


@dataclass
class CapturedPrefill:
    """The target's prefill of left-padded prompts with its feature layers captured (``prefill_capturing``)."""

    ids: torch.Tensor  # [B, W] left-padded prompt ids
    valid: torch.Tensor  # [B, W] bool: a real token
    positions: torch.Tensor  # [B, W]
    cache: KVCache  # the target's cache, the prompts written
    hidden: torch.Tensor  # [B, W, H] the final residual stream
    features: torch.Tensor  # [B, W, F*H] (``run_capturing``)


def prefill_capturing(
    m: EarlyExitModel, prompts: list[list[int]], capacity: int, layers: tuple[int, ...]
) -> CapturedPrefill:
    """Prefill the target over ``prompts`` (left-padded, a cache of ``capacity`` slots at least), capturing
    the residual stream after each of ``layers`` blocks: what a drafter reading the target's features starts
    from."""
    ids, valid, positions = left_pad(prompts, m.device)
    cache = m.new_cache(ids.shape[0], max(capacity, ids.shape[1]))
    cache.reserve(valid, 0, positions)
    hidden, features = run_capturing(m, m.embed(ids, positions), 0, positions, cache, layers=layers)
    return CapturedPrefill(ids, valid, positions, cache, hidden, features)
