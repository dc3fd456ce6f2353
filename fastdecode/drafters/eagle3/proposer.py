"""The EAGLE-3 proposer (Li et al., 2025): a one-layer head (``model.py``) drafts from the target features
that the verification has just computed.

``HeadRows`` keeps the head's keys and values in the target cache's slot layout. ``Eagle3Proposer`` drafts a
chain, or with ``decoder.eagle3.tree=true`` EAGLE-2's dynamic tree (``tree.py``), and after each verification
writes the kept tokens' rows from the target's real features in one head pass. Drafts score the head's draft
vocabulary, mapped to target ids; when sampling, q is zero outside it: lossless. Design notes:
docs/design/drafters.md.
"""

from __future__ import annotations

import torch

from fastdecode.decoding.common import Prefill
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.policies import LaggedFlag
from fastdecode.decoding.proposers import Proposer, one_hot, pick_token
from fastdecode.decoding.speculative import Draft, Round, Verdict, prefill_capturing
from fastdecode.drafters.eagle3.layer import causal_mask
from fastdecode.drafters.eagle3.model import Eagle3Head
from fastdecode.drafters.eagle3.options import Eagle3Options
from fastdecode.drafters.eagle3.tree import grow, node_budget
from fastdecode.plan.cost import CostModel
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.model import EarlyExitModel


class HeadRows:
    """The head's rows in the target cache's slot layout: a one-layer ``KVCache`` of ``batch`` rows and
    ``capacity`` slots (its ``key_valid``: which slots hold a row; rollback: its length pointer). ``m``: the
    target (its embedding, its position limit); ``head`` runs as the target's engine runs linears
    (``Engine.packed``: packed kernels with ``fast_linear``)."""

    def __init__(self, m: EarlyExitModel, head: Eagle3Head, batch: int, capacity: int) -> None:
        self.m = m
        self.head = m.engine.packed(head) if m.engine is not None else head
        cfg = head.config
        self.cache = KVCache(1, batch, cfg.num_key_value_heads, cfg.head_dim, capacity, m.dtype, m.device)

    def __len__(self) -> int:
        return self.cache.lengths[0]

    def add(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for ``tokens [B, T]`` at the next ``T`` slots: ``hidden [B, T, F*H]`` target features (of the
        positions before) or ``[B, T, H]`` the head's own output; ``positions [B, T]``; ``valid [B, T]``
        bool: rows later queries may attend to; ``mask`` bool ``[B, 1, T, past + T]``: the keys each row
        attends to (default: the valid earlier rows and causally the new ones; a token tree's rows pass
        their ancestors', ``tree.tree_keys``). -> ``(logits [B, T, S], hidden [B, T, H])``."""
        past, steps = len(self), tokens.shape[1]
        self.cache.reserve(valid, past, positions)
        keys = mask
        if keys is None:
            valid_keys = self.cache.key_valid[:, None, None, : past + steps]
            keys = valid_keys & causal_mask(steps, past, tokens.device)  # [B, 1, T, past + T]
            # a query whose row is invalid still sees its own key (never a query with no key)
            keys[..., past:] |= torch.eye(steps, dtype=torch.bool, device=tokens.device)
        pos = positions.clamp(max=self.m.config.max_position_embeddings - 1)
        return self.head(self.m.token_embed(tokens), hidden, pos, self.cache, keys)

    def crop(self, slots: int) -> None:
        """Keep the first ``slots`` slots (drop the rows drafting wrote)."""
        self.cache.crop(slots)


class Eagle3Proposer(Proposer):
    """Drafts with ``head`` (an ``Eagle3Head`` on the target's device and dtype) over its draft vocabulary;
    ``head_cost``: one head forward in plain decoding steps of the target (``fastdecode/plan/cost.py``)."""

    name = "eagle3"

    def __init__(
        self,
        m: EarlyExitModel,
        head: Eagle3Head,
        cfg: DecodeConfig,
        generator: torch.Generator,
        *,
        costs: CostModel,
        head_cost: float = 0.0,
    ) -> None:
        self.m, self.head, self.cfg, self.generator, self.costs = m, head, cfg, generator, costs
        self.head_cost = head_cost
        self.feature_layers = tuple(head.config.aux_layer_ids)
        draft_ids = torch.arange(head.config.draft_vocab_size, device=m.device)
        self.vocab = head.draft_to_target(draft_ids)  # [S] target ids of the head's columns
        self.head_rows: HeadRows | None = None  # built by ``start``
        self.prev: torch.Tensor | None = None  # [B, F*H]: features of the token before each row's last
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # the row of the next round's t
        self.retired = False
        self.flag = LaggedFlag(m.device)

    def start(self, m: EarlyExitModel, prompts: list[list[int]], capacity: int) -> Prefill:
        """Prefill the target, capturing the prompt's features, and the head's rows for the prompt."""
        pre = prefill_capturing(m, prompts, capacity, self.feature_layers)
        features = pre.features
        self.head_rows = HeadRows(
            m, self.head, len(prompts), pre.cache.capacity
        )  # (kept if a chain retired it)
        before = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1)  # features at p - 1
        self.head_rows.add(pre.ids, before, pre.positions, pre.valid & (pre.positions > 0))
        self.prev, self.pending = features[:, -1], None
        lengths = torch.tensor([len(p) for p in prompts], device=m.device)
        return Prefill(pre.cache, lengths, m.exit_logits(pre.hidden[:, -1]))

    def last_row(self, r: Round) -> tuple[torch.Tensor, torch.Tensor]:
        """The row of ``r.last`` at slot ``r.start``, from the features of the token before it."""
        on = torch.ones_like(r.active)[:, None]
        return self.head_rows.add(r.last[:, None], self.prev[:, None], r.positions[:, None], on)

    # -- drafting -----------------------------------------------------------------------------------------
    def propose(self, r: Round) -> Draft:
        """Drafts up to ``r.limit`` tokens. A dynamic policy's stop flag is read before the next row's pass:
        unlike a self-speculative draft, whose last token must pass the draft layers anyway, that pass is
        wasted when the draft stops (``update`` writes the kept rows from the target's features)."""
        passes = 1  # this round's ``update`` pass (which also writes the next round's row of t)
        if self.pending is None:
            self.pending = self.last_row(r)
            passes += 1
        (logits, hidden), self.pending = self.pending, None
        if Eagle3Options.of(self.cfg).tree and r.limit > 0:
            return self.propose_tree(r, logits, hidden, passes)
        rows, cfg, policy, flag = self.head_rows, self.cfg, self.policy, self.flag
        base, tokens, probs = len(rows), [], []
        on = torch.ones_like(r.active)[:, None]
        flag.reset()
        for i in range(r.limit):
            if i:  # the row of the token just drafted, on the head's own hidden state
                if not flag.read():
                    break
                logits, hidden = rows.add(tokens[-1][:, None], hidden, (r.positions + i)[:, None], on)
                passes += 1
            token, q, confidence = pick_token(
                logits[:, -1],
                cfg,
                generator=self.generator,
                vocab=self.vocab,
                vocab_size=self.m.vocab_size,
                want_probs=policy.dynamic,
            )
            tokens.append(token)
            probs.append(q)
            if policy.dynamic:
                flag.push(policy.keep_drafting(confidence, r.active))
        rows.crop(base)
        batch, live = r.last.shape[0], int(r.active.sum())
        drafted = torch.stack(tokens, 1) if tokens else r.last.new_zeros(batch, 0)
        q_all = None
        if not cfg.greedy:
            empty = torch.zeros(batch, 0, self.m.vocab_size, device=r.last.device)
            q_all = torch.stack(probs, 1) if probs else empty
        return Draft(drafted, q_all, None, layers_run=passes * live, layer_calls=passes)

    def propose_tree(self, r: Round, logits: torch.Tensor, hidden: torch.Tensor, passes: int) -> Draft:
        """An EAGLE-2 dynamic tree from t's row ``(logits [B, 1, S], hidden [B, 1, H])``
        (``tree.grow``); the head's cache is cropped back to where it stood."""
        rows, batch, live = self.head_rows, r.last.shape[0], int(r.active.sum())
        base, top_k = len(rows), min(Eagle3Options.of(self.cfg).top_k, self.vocab.numel())
        pool, grown = grow(rows, (logits, hidden), r.positions, self.vocab, levels=r.limit, top_k=top_k)
        rows.crop(base)
        width = min(r.limit, pool.size)
        if self.policy.cost_aware:
            width = node_budget(torch.cat(pool.scores, 1), r.active, self.costs, width)
        calls, run = passes + grown, (passes + grown * top_k) * live
        if width == 0:  # no tree pays for its verification: a plain step (an empty chain)
            empty = r.last.new_zeros(batch, 0)
            probs = None if self.cfg.greedy else one_hot(empty, self.m.vocab_size)
            return Draft(empty, probs, None, layers_run=run, layer_calls=calls)
        drafted, parents, _ = pool.best(width)
        tokens = self.vocab[drafted]
        probs = None if self.cfg.greedy else one_hot(tokens, self.m.vocab_size)
        return Draft(tokens, probs, None, parents=parents, layers_run=run, layer_calls=calls)

    def absorb(self, r: Round, tokens: torch.Tensor, lengths: list[int], source: str) -> Draft:
        """A deterministic draft made elsewhere: the head still writes the row of ``r.last``."""
        if not self.retired and self.pending is None:
            self.last_row(r)
        self.pending = None
        probs = None if self.cfg.greedy else one_hot(tokens, self.m.vocab_size)
        return Draft(tokens, probs, list(lengths), sources=[source] * len(lengths))

    def retire(self) -> None:
        """A chain stopped its drafts for the rest of the call: the head's rows are not kept any more."""
        self.retired = True

    def update(self, r: Round, draft: Draft, verdict: Verdict, done) -> None:
        """In one head pass, the rows of the kept drafts d1..d_a with the features the verification computed
        at t, d1..d_{a-1} (holes where a row kept fewer than the batch's longest), and the row of the
        verifier's token with the features of d_a: the next round's first draft."""
        if self.retired:
            return
        features = draft.features  # [B, k+1, F*H] at [t, d1..dk]
        device = features.device
        kept = torch.tensor(done.kept, device=device)
        longest = max(done.kept)
        self.prev = features[torch.arange(features.shape[0], device=device), kept]  # [B, F*H]
        offsets = torch.arange(longest, device=device)
        tokens = torch.cat([draft.tokens[:, :longest], verdict.next_token[:, None]], 1)  # [B, longest + 1]
        hidden = torch.cat([features[:, :longest], self.prev[:, None]], 1)
        positions = torch.cat([r.positions[:, None] + 1 + offsets, (r.positions + kept + 1)[:, None]], 1)
        valid = torch.cat(
            [offsets[None, :] < kept[:, None], torch.ones_like(kept, dtype=torch.bool)[:, None]], 1
        )
        logits, out = self.head_rows.add(tokens, hidden, positions, valid)
        self.pending = (logits[:, -1:], out[:, -1:])

    def token_cost(self) -> float:
        return self.head_cost

    def ride_cost(self) -> float:
        return self.head_cost  # ``update`` writes the kept tokens' rows: one head pass

    def round_cost(self, drafted: int) -> float:
        # one head pass per drafted token: the first is the last round's catch-up pass (``update``)
        return self.costs.round_cost(drafted, self.head_cost, 0)
