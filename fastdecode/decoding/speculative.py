"""What the draft-then-verify decoders share (``self_speculative``, ``assisted``): the draft loop, the lossless
acceptance rule, rollback of a cache by its length pointer, and the per-round host bookkeeping.

A drafter is a model plus a depth: ``self_speculative`` drafts with the target's own layers ``< E`` (writing
into the one shared cache), ``assisted`` with every layer of a separate draft model (writing into the
drafter's own cache). Either way one round is::

    draft:   t, d1, .., d_{k-1} through the drafter one at a time -> d1..dk; then d_k through it too
    verify:  the target scores [t, d1..dk] (k+1 positions) in one pass
    accept:  per row a_b drafts (greedy prefix match, or the lossless sampling rule) plus one token from the
             verifier (correction or bonus); every cache is cropped to the same length, with holes

Why d_k always passes the drafter: self-speculation verifies on its hidden state, and a separate drafter's
cache must hold every accepted token (d_k is accepted whenever the whole draft is). It also lets dynamic
policies read their stop flag one token late (``LaggedFlag``): the pass of the last token is launched before
the host knows the draft has ended, and it is never wasted work to throw away.

Draft vocabulary subsets (``DecodeConfig.draft_vocab``, built by ``fastdecode/data/draft_vocab.py``): the
drafter's head computes logits over a subset of rows only; greedy drafting takes the argmax within the subset,
sampling draws from the processed distribution over the subset, which - scattered into the full vocabulary,
zero elsewhere - is exactly the ``q`` the acceptance rule needs. Verification keeps the full head, so decoding
stays lossless whatever the subset.

Exit adapters (``fastdecode/exit_adapter.py``, Kangaroo): with ``adapter`` set, the drafter's head reads the
adapter's output instead of the raw exit hidden state; the hidden states returned for verification stay the
raw ones (lossless). The adapter's attention has its own cache layer (``adapter.slot``). Every token it sees
once: the last token of a draft (d_k, or t when nothing is drafted) is never proposed from, so it is kept in a
backlog and passes the adapter together with the next round's first token, if rollback kept its slot (the
adapter's keys/values depend only on each token's own exit hidden state and position, so that late write is
exactly what an immediate one would have been).

Compiled and static-shape execution is the engine's (``fastdecode/engine.py``: ``decoder.static_cache``,
``decoder.compile``); this module is the same on every path. Measurements: docs/BENCHMARKS.md.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any, NamedTuple

import torch

from fastdecode.cache import KVCache
from fastdecode.decoding.common import DecodeConfig, DecodeOutput, Rows, choose, probabilities, sample
from fastdecode.decoding.policies import POLICIES, DraftPolicy, LaggedFlag
from fastdecode.model import EarlyExitModel


@dataclass
class Draft:
    """What the drafter produced in one round, for the verifier to rule on (``accept``)."""

    hidden: torch.Tensor  # [B, k+1, H]: drafter outputs (residual stream at its depth) of [t, d1..dk]
    tokens: torch.Tensor  # [B, k] drafted tokens (full-vocabulary ids)
    probs: torch.Tensor | None  # [B, k, V] processed drafter probabilities, full vocab (sampling only)


class Verdict(NamedTuple):
    """The verifier's ruling on one round (``accept``), one entry per row: all ``[B]`` long."""

    accepted: torch.Tensor  # leading drafts accepted (greedy: prefix match; sampling: the lossless rule)
    next_token: torch.Tensor  # the verifier's own token after them (correction, or bonus if all accepted)
    oracle: torch.Tensor  # leading drafts equal to the verifier's argmax (the best greedy draft length)


def new_policy(cfg: DecodeConfig, *, cost_ratio: float) -> DraftPolicy:
    """The draft-length policy ``cfg.policy`` with K = ``cfg.draft_tokens``; ``cost_ratio`` = draft pass /
    full pass (what ``adaptive`` weighs a further draft token against)."""
    return POLICIES[cfg.policy](cfg.draft_tokens, threshold=cfg.confidence_threshold, cost_ratio=cost_ratio)


def propose(
    d: EarlyExitModel,
    hidden: torch.Tensor,
    cfg: DecodeConfig,
    *,
    generator: torch.Generator,
    vocab: torch.Tensor | None,
    want_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One draft token from the drafter's residual stream ``hidden [B, H]``.

    Returns (token [B] full-vocab id, q [B, V] the distribution it was drawn from (sampling only; zero
    outside ``vocab [S]`` when a subset is used), confidence [B] = its processed probability, or None when
    neither sampling nor ``want_probs`` needs it).
    """
    logits = d.exit_logits(hidden) if vocab is None else d.exit_logits_subset(hidden, vocab)  # [B, V|S]
    q = probabilities(logits, cfg) if want_probs or not cfg.greedy else None
    index = choose(logits, q, cfg, generator)  # [B], into the subset when there is one
    confidence = None if q is None else q.gather(-1, index[:, None])[:, 0]
    if vocab is None:
        return index, q, confidence
    if not cfg.greedy:
        q = q.new_zeros(q.shape[0], d.vocab_size).scatter_(-1, vocab.expand(q.shape[0], -1), q)
    return vocab[index], q, confidence


@dataclass
class Drafter:
    """Drafts with layers ``[0, depth)`` of ``model`` and its exit head, writing the drafter's KV into
    ``cache``; ``vocab [S]``: the draft vocabulary subset, or None for the full head. Fields after ``depth``
    are keyword-only."""

    model: EarlyExitModel
    depth: int
    _: KW_ONLY
    cache: KVCache
    policy: DraftPolicy
    cfg: DecodeConfig
    generator: torch.Generator
    vocab: torch.Tensor | None = None
    adapter: Any = None  # an ExitAdapter at exit ``depth`` (fastdecode/exit_adapter.py), or None
    flag: LaggedFlag = field(init=False)  # the dynamic policies' stop flag, read one token late
    # Exit hidden states [B, n, H] and positions [B, n] of the slots the adapter has not seen yet (the slots
    # [cache.lengths[adapter.slot], cache.lengths[0]) once rollback has cut them; see the module docstring).
    backlog: tuple[torch.Tensor, torch.Tensor] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.flag = LaggedFlag(self.model.device)

    def _adapt(self, hidden: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The adapter's output for the newest token (``hidden [B, 1, H]`` at ``pos [B, 1]``), after it has
        seen the backlog; its cache layer then holds every slot up to this token's."""
        if self.backlog is not None:
            hidden = torch.cat([self.backlog[0], hidden], 1)
            pos = torch.cat([self.backlog[1], pos], 1)
            self.backlog = None
        return self.adapter(self.model, hidden, pos, cache=self.cache)[:, -1:]

    def _push_backlog(self, hidden: torch.Tensor, pos: torch.Tensor) -> None:
        if self.backlog is None:
            self.backlog = (hidden, pos)
        else:
            self.backlog = (torch.cat([self.backlog[0], hidden], 1), torch.cat([self.backlog[1], pos], 1))

    def _trim_backlog(self) -> None:
        """Rollback may have cut slots the backlog holds: keep the ones still in the cache."""
        if self.backlog is None:
            return
        unseen = self.cache.lengths[0] - self.cache.lengths[self.adapter.slot]
        hidden, pos = self.backlog
        self.backlog = (hidden[:, :unseen], pos[:, :unseen]) if unseen > 0 else None

    def draft(self, last: torch.Tensor, positions: torch.Tensor, active: torch.Tensor, limit: int) -> Draft:
        """Draft up to ``limit`` tokens after ``last [B]`` (at ``positions [B]``); ``active [B]`` marks the
        rows still decoding (the others write slots nobody attends to)."""
        d, cache, policy, flag, cfg = self.model, self.cache, self.policy, self.flag, self.cfg
        max_position = d.config.max_position_embeddings - 1  # rows past their budget: positions never used
        hiddens, tokens, probs = [], [], []
        policy.begin()
        flag.reset()
        if self.adapter is not None:
            self._trim_backlog()
        token = last
        for i in range(limit + 1):
            pos = (positions + i).clamp(max=max_position)[:, None]  # [B, 1]
            cache.reserve(active[:, None], cache.lengths[0], pos)
            hidden = d.run_layers(d.embed(token[:, None], pos), 0, self.depth, pos, cache=cache)
            hiddens.append(hidden)
            # The flag about `token` (pushed last step) is read only now, after its pass was launched: no stall.
            if i == limit or not flag.read():
                if self.adapter is not None:  # never proposed from: the adapter sees it next round
                    self._push_backlog(hidden, pos)
                break
            head_input = hidden if self.adapter is None else self._adapt(hidden, pos)
            token, q, confidence = propose(
                d,
                head_input[:, -1],
                cfg,
                generator=self.generator,
                vocab=self.vocab,
                want_probs=policy.dynamic,
            )
            tokens.append(token)
            if not cfg.greedy:
                probs.append(q)
            if policy.dynamic:
                flag.push(policy.keep_drafting(confidence, active))
        batch = last.shape[0]
        drafted = torch.stack(tokens, 1) if tokens else last.new_zeros(batch, 0)
        q_all = None
        if not cfg.greedy:
            q_all = torch.stack(probs, 1) if probs else torch.zeros(batch, 0, d.vocab_size, device=d.device)
        return Draft(torch.cat(hiddens, 1), drafted, q_all)


def accept(logits: torch.Tensor, draft: Draft, cfg: DecodeConfig, *, generator: torch.Generator) -> Verdict:
    """Rule on ``draft`` from the verifier's ``logits [B, k+1, V]`` at ``[t, d1..dk]``; ``generator`` draws
    the acceptance tests and the residual token when sampling."""
    k = draft.tokens.shape[1]
    target = logits.argmax(-1)  # [B, k+1]
    oracle = (draft.tokens == target[:, :k]).long().cumprod(-1).sum(-1)
    if cfg.greedy:
        return Verdict(accepted=oracle, next_token=target.gather(1, oracle[:, None])[:, 0], oracle=oracle)
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
    return Verdict(accepted=accepted, next_token=sample(residual, generator), oracle=oracle)


def rollback(cache: KVCache, start: int, *, accepted: torch.Tensor, longest: int) -> None:
    """Keep slots ``[start, start + longest]`` (t plus the longest accepted run); rows that accepted fewer
    drafts (``accepted [B]``, at most ``longest``) get their rejected slots masked (holes)."""
    cache.crop(start + longest + 1)
    offsets = torch.arange(longest + 1, device=accepted.device)  # [longest + 1]
    keep = offsets[None, :] <= accepted[:, None]  # [B, longest + 1]
    cache.key_valid[:, start : start + longest + 1] &= keep


def settle(
    rows: Rows,
    out: DecodeOutput,
    *,
    policy: DraftPolicy,
    draft: Draft,
    verdict: Verdict,
    caches: list[KVCache],
    start: int,
) -> torch.Tensor:
    """End a round that began at slot ``start``: emit each decoding row's accepted drafts and verifier token,
    roll every cache back to the same length, book the statistics. Returns the kept drafts [B] (accepted, cut
    at EOS / the budget), 0 for rows that no longer decode."""
    accepted, last, oracle = verdict.accepted, verdict.next_token, verdict.oracle
    live, k, batch = rows.active, draft.tokens.shape[1], len(rows.tokens)
    # The one host sync per round: emitted tokens decide EOS, budgets and the rollback length.
    host = torch.cat([draft.tokens, last[:, None], accepted[:, None], oracle[:, None]], 1).tolist()
    per_row: list[int | None] = [None] * batch  # accepted drafts of the rows decoding this round
    kept = [0] * batch  # drafts whose slots stay valid
    for row in live:
        per_row[row] = a = host[row][k + 1]
        kept[row] = rows.emit(row, host[row][:a] + [host[row][k]]) - 1
    kept_t = torch.tensor(kept, device=last.device)
    for cache in caches:
        rollback(cache, start, accepted=kept_t, longest=max(kept))
    out.record([per_row[row] for row in live], k, [host[row][k + 2] for row in live])
    policy.update(per_row, k)
    out.steps += 1
    return kept_t
