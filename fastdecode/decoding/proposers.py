"""Proposers: the base of every drafter that the speculative loop (``speculative.speculate``) verifies.

A ``Proposer`` owns what its drafts depend on and what they cost: its prefill and caches, its draft
vocabulary, its cost per drafted token and per round in plain decoding steps (``fastdecode/plan/cost.py``),
its state between rounds. ``ModelProposer`` drafts token by token through a model's first blocks (the
subclasses are ``fastdecode/drafters/exits/proposer.py`` and ``fastdecode/drafters/draft_model/proposer.py``).
``merge_forced``, ``propose_token`` and ``pick_token`` are helpers the drafters share. Design notes:
docs/design/decoding.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fastdecode.decoding.common import Prefill, choose, prefill, probabilities
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.policies import DraftPolicy, LaggedFlag
from fastdecode.decoding.speculative import Draft, Round, Verdict
from fastdecode.plan.cost import CostModel
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.model import EarlyExitModel

Forced = tuple[torch.Tensor, list[int]]  # a chain's first-stage drafts [B, m] and their lengths (0: none)
MARGINAL_SPAN = 16  # marginal costs computed for drafts up to this long (longer ones reuse the last)


class Proposer:
    """Base of the proposers. ``name`` labels its drafts; ``depth``: target blocks its drafts leave run (the
    verifier runs the rest); ``costs``: the target's cost model; ``policy``: set by the loop.

    A proposer that may follow prompt lookup in a chain (``chain.ChainProposer``) also drafts with some rows'
    tokens forced (``draft``), takes a whole draft made elsewhere (``absorb``) and stops drafting when the
    chain retires it (``retire``): the defaults here serve a proposer that keeps no cache of its own."""

    name: ClassVar[str] = "proposer"
    vocab: torch.Tensor | None = None
    depth: int = 0
    # hidden-state ids of the target whose states the proposer reads after each verification
    # (``Draft.features``, captured by ``speculative.verify``); () for none: one unsplit verification pass
    feature_layers: tuple[int, ...] = ()
    costs: CostModel
    policy: DraftPolicy

    def start(self, m: EarlyExitModel, prompts: list[list[int]], capacity: int) -> Prefill:
        """Prefill the prompts (the target's cache, and the proposer's own)."""
        return prefill(m, prompts, capacity)

    def token_cost(self) -> float:
        """One drafted token, in plain decoding steps of the target."""
        return 0.0

    def round_cost(self, drafted: int) -> float:
        """A round of ``drafted`` tokens and their verification, in plain decoding steps."""
        return self.costs.round_cost(drafted, self.token_cost(), self.depth)

    def ride_cost(self) -> float:
        """What this drafter costs in a chain's round that prompt lookup drafted (its state kept up to date),
        in plain decoding steps; ``kinds.Offer.ride_cost`` plans with the same."""
        return 0.0

    def marginal_costs(self, max_tokens: int) -> list[float]:
        """``[j]``: what the (j+1)-th drafted token adds to a round (what ``adaptive`` weighs)."""
        span = max(max_tokens, MARGINAL_SPAN)
        return [self.round_cost(j + 1) - self.round_cost(j) for j in range(span)]

    def caches(self) -> list[KVCache]:
        """Caches besides the target's that roll back with it."""
        return []

    def propose(self, r: Round) -> Draft:
        raise NotImplementedError

    def draft(self, r: Round, forced: Forced | None = None, first: str = "prompt_lookup") -> Draft:
        """Its own draft, where rows ``b`` with ``forced[1][b] > 0`` draft ``forced[0][b, :forced[1][b]]``
        instead (deterministic: q one-hot), their source ``first`` (the chain's first stage)."""
        own = self.propose(r)
        if forced is None:
            return own
        return merge_forced(own, forced, self.name, first)

    def absorb(self, r: Round, tokens: torch.Tensor, lengths: list[int], source: str) -> Draft:
        """A deterministic draft made elsewhere (``tokens [B, k]``, ``lengths`` per row), as its own."""
        return Draft(tokens, None, list(lengths), sources=[source] * len(lengths))

    def retire(self) -> None:
        """A chain stopped its drafting for the rest of the call."""

    def feedback(self, done: Any) -> tuple[list[int | None], list[int | None]]:
        """What the draft-length policy learns from a settled round: accepted and drafted per row (None:
        a row it did not draft)."""
        return done.accepted, done.lengths

    def update(self, r: Round, draft: Draft, verdict: Verdict, done: Any) -> None:
        """After a round settled (``speculative.Settled``)."""

    def finish(self, out: Any) -> None:
        """After the call decoded ``out`` (``DecodeOutput``): suffix decoding's outputs join its index."""


def merge_forced(own: Draft, forced: Forced, name: str, first: str = "prompt_lookup") -> Draft:
    """``own`` (drafted by ``name``) with the rows that ``forced`` names replaced by their forced tokens
    (q one-hot when sampling; their source ``first``)."""
    tokens, lengths = forced
    width = max(own.k, tokens.shape[1])
    pad = torch.zeros(tokens.shape[0], width, dtype=torch.long, device=tokens.device)
    merged, mine = pad.clone(), pad.clone()
    merged[:, : tokens.shape[1]] = tokens
    mine[:, : own.k] = own.tokens
    use = torch.tensor([n > 0 for n in lengths], device=tokens.device)[:, None]
    merged = torch.where(use, merged, mine)
    own_lengths = own.row_lengths()
    row_lengths = [n if n > 0 else own_lengths[b] for b, n in enumerate(lengths)]
    probs = None
    if own.probs is not None:
        vocab_size = own.probs.shape[-1]
        mine_q = torch.zeros(*merged.shape, vocab_size, device=merged.device)
        mine_q[:, : own.k] = own.probs
        probs = torch.where(use[..., None], one_hot(merged, vocab_size), mine_q)
    sources = [first if n > 0 else name for n in lengths]
    return Draft(merged, probs, row_lengths, sources=sources)


def one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[...]`` ids -> ``[..., V]`` fp32: the q of a deterministic draft."""
    return F.one_hot(tokens, vocab_size).float()


def propose_token(
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
    return pick_token(
        logits, cfg, generator=generator, vocab=vocab, vocab_size=d.vocab_size, want_probs=want_probs
    )


def pick_token(
    logits: torch.Tensor,
    cfg: DecodeConfig,
    *,
    generator: torch.Generator,
    vocab: torch.Tensor | None,
    vocab_size: int,
    want_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One draft token from a drafter's ``logits [B, V|S]`` (over ``vocab [S]``, full-vocabulary ids, when a
    subset is scored); returns what ``propose_token`` does, ``q`` over the ``vocab_size`` full ids."""
    q = probabilities(logits, cfg) if want_probs or not cfg.greedy else None
    index = choose(logits, q, cfg, generator)  # [B], into the subset when there is one
    confidence = None if q is None else q.gather(-1, index[:, None])[:, 0]
    if vocab is None:
        return index, q, confidence
    if not cfg.greedy:
        q = q.new_zeros(q.shape[0], vocab_size).scatter_(-1, vocab.expand(q.shape[0], -1), q)
    return vocab[index], q, confidence


class ModelProposer(Proposer):
    """Drafts token by token through blocks ``[0, blocks)`` of ``model`` and its head, writing into ``cache``
    (set by ``start``). Subclasses say which model, which cache and what the verifier receives."""

    def __init__(self, model: EarlyExitModel, blocks: int, cfg: DecodeConfig, generator: torch.Generator):
        self.model, self.blocks, self.cfg, self.generator = model, blocks, cfg, generator
        self.adapter: Any = None
        self.cache: KVCache | None = None
        self.flag = LaggedFlag(model.device)
        # Exit hidden states [B, n, H] and positions [B, n] of the slots the adapter has not seen yet (the
        # slots [cache.lengths[adapter.slot], cache.lengths[0]) once rollback has cut them).
        self.backlog: tuple[torch.Tensor, torch.Tensor] | None = None
        self.adapter_retired = False

    # -- the exit adapter's backlog ---------------------------------------------------------------------
    def _adapt(self, hidden: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The adapter's output for the newest token (``hidden [B, 1, H]`` at ``pos [B, 1]``), after it has
        seen the backlog; its cache layer then holds every slot up to this token's."""
        if self.backlog is not None:
            hidden = torch.cat([self.backlog[0], hidden], 1)
            pos = torch.cat([self.backlog[1], pos], 1)
            self.backlog = None
        return self.adapter(self.model, hidden, pos, cache=self.cache)[:, -1:]

    def retire(self) -> None:
        """Its own drafts have stopped (a chain retired it): the adapter never reads its cache layer again,
        so nothing more is kept for it. Passing drafts through its layers (``absorb``) goes on."""
        self.adapter_retired, self.backlog = True, None

    def _push_backlog(self, hidden: torch.Tensor, pos: torch.Tensor) -> None:
        if self.adapter is None or self.adapter_retired:
            return
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

    # -- drafting -----------------------------------------------------------------------------------------
    def _positions(self, r: Round, steps: int) -> torch.Tensor:
        offsets = torch.arange(steps, device=self.model.device)
        return (r.positions[:, None] + offsets).clamp(max=self.model.config.max_position_embeddings - 1)

    def draft(self, r: Round, forced: Forced | None = None, first: str = "prompt_lookup") -> Draft:
        """Draft up to ``r.limit`` tokens after ``r.last``. ``forced``: ``(tokens [B, m], lengths)``: row b
        drafts ``tokens[b, :lengths[b]]`` first (the match of a chain's ``first`` stage), then its own."""
        d, cache, policy, flag, cfg = self.model, self.cache, self.policy, self.flag, self.cfg
        fixed = 0 if forced is None else max(forced[1])
        limit = max(r.limit, fixed)
        hiddens, tokens, probs = [], [], []
        flag.reset()
        self._trim_backlog()
        token, voters = r.last, r.active
        for i in range(limit + 1):
            pos = (r.positions + i).clamp(max=d.config.max_position_embeddings - 1)[:, None]  # [B, 1]
            cache.reserve(r.active[:, None], cache.lengths[0], pos)
            hidden = d.run_layers(d.embed(token[:, None], pos), 0, self.blocks, pos, cache=cache)
            hiddens.append(hidden)
            # The flag about `token` (pushed last step) is read only now, after its pass was launched: no stall.
            if i == limit or (i >= fixed and not flag.read()):
                self._push_backlog(hidden, pos)  # never proposed from: the adapter sees it next round
                break
            head_input = hidden if self.adapter is None else self._adapt(hidden, pos)
            token, q, confidence = propose_token(
                d,
                head_input[:, -1],
                cfg,
                generator=self.generator,
                vocab=self.vocab,
                want_probs=policy.dynamic,
            )
            if i < fixed:
                use = torch.tensor([i < n for n in forced[1]], device=d.device)  # [B] rows drafting the match
                token = torch.where(use, forced[0][:, i], token)
                if q is not None and not cfg.greedy:
                    q = torch.where(use[:, None], one_hot(token, d.vocab_size), q)
                voters = r.active & ~use
            tokens.append(token)
            if not cfg.greedy:
                probs.append(q)
            if policy.dynamic:
                flag.push(policy.keep_drafting(confidence, voters))
        batch, k = r.last.shape[0], len(tokens)
        drafted = torch.stack(tokens, 1) if tokens else r.last.new_zeros(batch, 0)
        q_all = None
        if not cfg.greedy:
            q_all = torch.stack(probs, 1) if probs else torch.zeros(batch, 0, d.vocab_size, device=d.device)
        live = int(r.active.sum())
        adapted = 0 if self.adapter is None else k  # adapter passes (the backlog rides along with them)
        return self._draft(
            drafted,
            q_all,
            torch.cat(hiddens, 1),
            layers_run=((k + 1) * self.blocks + adapted) * live,
            layer_calls=(k + 1) * self.blocks + adapted,
            sources=None if forced is None else [self.name if n == 0 else first for n in forced[1]],
        )

    def absorb(self, r: Round, tokens: torch.Tensor, lengths: list[int], source: str) -> Draft:
        """A draft made elsewhere (``tokens [B, k]``, ``lengths`` per row, deterministic) passed through the
        drafter in one forward, so its cache holds [t, d1..dk] like after its own draft."""
        d, cache, k = self.model, self.cache, tokens.shape[1]
        self._trim_backlog()
        ids = torch.cat([r.last[:, None], tokens], 1)
        pos = self._positions(r, k + 1)
        cache.reserve(r.active[:, None].expand_as(ids), cache.lengths[0], pos)
        hidden = d.run_layers(d.embed(ids, pos), 0, self.blocks, pos, cache=cache)
        self._push_backlog(hidden, pos)
        probs = None if self.cfg.greedy else one_hot(tokens, d.vocab_size)
        live = int(r.active.sum())
        draft = self._draft(
            tokens, probs, hidden, layers_run=(k + 1) * self.blocks * live, layer_calls=self.blocks
        )
        draft.lengths, draft.sources = lengths, [source] * len(lengths)
        return draft

    def _draft(self, tokens, probs, hidden, *, layers_run: int, layer_calls: int, sources=None) -> Draft:
        raise NotImplementedError

    def propose(self, r: Round) -> Draft:
        return self.draft(r)
