"""The DFlash proposer (Chen et al., 2026): one drafter forward per round drafts a whole block.

``ContextCache`` keeps each draft layer's context keys and values in the target cache's slot layout, written
once per verified token from the features its verification captured. ``DFlashProposer`` runs the block
``[t, MASK x (slots - 1)]`` over that context, scores slots 1..k with the target's head and drafts their
argmax (a point mass when sampling: the loop's rule stays lossless). ``block_round_cost``: a round's price.
Design notes: docs/design/dflash.md.
"""

from __future__ import annotations

import torch

from fastdecode.decoding.common import Prefill, probabilities
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.proposers import Proposer, one_hot
from fastdecode.decoding.speculative import Draft, Round, Verdict, prefill_capturing
from fastdecode.drafters.dflash.layer import DFlashDraft
from fastdecode.plan.cost import CostModel
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.model import EarlyExitModel


class ContextCache:
    """The drafter's context in the target cache's slot layout: a ``KVCache`` with one layer per draft layer
    (slot s: the keys and values of the token in the target's slot s; ``key_valid``: left padding and the
    holes of ragged acceptance). Only verified tokens are written, so it never rolls back. ``net``: the
    drafter as it runs (``Engine.packed``: the engine's linears)."""

    def __init__(self, m: EarlyExitModel, net: DFlashDraft, batch: int, capacity: int) -> None:
        cfg = net.config
        self.net = net
        layers, heads, dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.cache = KVCache(layers, batch, heads, dim, capacity, m.dtype, m.device)

    def __len__(self) -> int:
        return self.cache.lengths[0]

    def write(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """The context of ``features [B, T, F*H]`` (the target's, at the drafter's feature layers) at
        ``positions [B, T]`` into the next ``T`` slots; ``valid [B, T]``: the slots a block may attend to."""
        self.cache.reserve(valid, len(self), positions)
        for layer, (keys, values) in enumerate(self.net.context_kv(features, positions)):
            self.cache.update(keys, values, layer)

    def run(self, noise: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One drafter forward of a block ``noise [B, Q, H]`` at ``positions [B, Q]`` over every valid
        context slot and the whole block (no causal mask) -> the final-normed hidden states ``[B, Q, H]``.
        The block's own keys are never stored."""
        cache, past = self.cache, len(self)
        context = [(k[:, :, :past], v[:, :, :past]) for k, v in zip(cache.k, cache.v, strict=True)]
        block = cache.key_valid.new_ones(noise.shape[0], noise.shape[1])
        keys = torch.cat([cache.key_valid[:, :past], block], 1)[:, None, None, :]  # [B, 1, 1, past + Q]
        return self.net(noise, positions, context, keys)


def block_round_cost(costs: CostModel, drafted: int, pass_cost: float, write_cost: float) -> float:
    """A round of ``drafted`` tokens in plain decoding steps: the verification of ``drafted + 1`` tokens,
    the context write of the kept ones (``write_cost``) and, when it drafts, one drafter pass over the block
    (``pass_cost``, whatever ``drafted``) and the target's head over the ``drafted`` slots."""
    own = pass_cost + costs.head_cost(drafted) if drafted else 0.0
    return costs.round_cost(drafted, 0.0, 0) + write_cost + own


class DFlashProposer(Proposer):
    """Drafts with ``draft`` (a ``DFlashDraft`` on the target's device and dtype) over blocks of ``slots``
    (default: its ``block_size``); ``pass_cost``: one drafter forward over the block, ``write_cost``: one
    round's context write, both in plain decoding steps of the target (``kind.pass_costs``)."""

    name = "dflash"

    def __init__(
        self,
        m: EarlyExitModel,
        draft: DFlashDraft,
        cfg: DecodeConfig,
        *,
        costs: CostModel,
        slots: int | None = None,
        pass_cost: float = 0.0,
        write_cost: float = 0.0,
    ) -> None:
        self.m, self.drafter, self.cfg, self.costs = m, draft, cfg, costs
        self.slots = slots or draft.config.block_size
        self.pass_cost, self.write_cost = pass_cost, write_cost
        self.feature_layers = tuple(draft.config.feature_ids)
        self.context: ContextCache | None = None  # built by ``start``
        self.masks: torch.Tensor | None = None  # [1, 1, H]: the mask token's embedding
        self.retired = False
        self.passes = 0  # drafter forwards this call

    def clamped(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.clamp(max=self.m.config.max_position_embeddings - 1)

    def start(self, m: EarlyExitModel, prompts: list[list[int]], capacity: int) -> Prefill:
        """Prefill the target, capturing the prompt's features, and write every prompt token's context."""
        pre = prefill_capturing(m, prompts, capacity, self.feature_layers)
        net = m.engine.packed(self.drafter) if m.engine is not None else self.drafter
        self.context = ContextCache(m, net, len(prompts), pre.cache.capacity)
        self.context.write(pre.features, self.clamped(pre.positions), pre.valid)
        mask = torch.tensor([[self.drafter.config.mask_token_id]], device=m.device)
        self.masks = m.token_embed(mask)
        lengths = torch.tensor([len(p) for p in prompts], device=m.device)
        return Prefill(pre.cache, lengths, m.exit_logits(pre.hidden[:, -1]))

    # -- drafting -----------------------------------------------------------------------------------------
    def block(self, r: Round) -> torch.Tensor:
        """The drafter's one forward of the round: ``[t, MASK x (slots - 1)]`` at t's position onwards over
        the context slots before t's -> final-normed hidden states ``[B, slots, H]``."""
        if len(self.context) != r.start:
            raise RuntimeError(f"DFlash context holds {len(self.context)} slots, the target's {r.start}")
        batch = r.last.shape[0]
        masks = self.masks.expand(batch, self.slots - 1, -1)
        noise = torch.cat([self.m.token_embed(r.last[:, None]), masks], 1)
        offsets = torch.arange(self.slots, device=r.last.device)
        self.passes += 1
        return self.context.run(noise, self.clamped(r.positions[:, None] + offsets))

    def propose(self, r: Round) -> Draft:
        """Up to ``min(r.limit, slots - 1)`` drafts from one drafter forward: the argmax of the target's head
        on slots 1..k (q one-hot when sampling); a dynamic policy cuts them where its stop rule, run over the
        slots' confidences in order, stops (``cut``)."""
        batch, vocab = r.last.shape[0], self.m.vocab_size
        k = min(r.limit, self.slots - 1)
        if k <= 0 or self.retired:  # a plain step
            empty = r.last.new_zeros(batch, 0)
            return Draft(empty, None if self.cfg.greedy else one_hot(empty, vocab))
        logits = self.m.head_logits(self.block(r)[:, 1 : k + 1])  # [B, k, V]
        tokens = logits.argmax(-1)
        if self.policy.dynamic:
            tokens = tokens[:, : self.cut(logits, tokens, r.active)]
        probs = None if self.cfg.greedy else one_hot(tokens, vocab)
        layers = self.drafter.config.num_hidden_layers
        live = int(r.active.sum())
        return Draft(tokens, probs, layers_run=layers * self.slots * live, layer_calls=layers)

    def cut(self, logits: torch.Tensor, tokens: torch.Tensor, active: torch.Tensor) -> int:
        """The drafts a dynamic policy keeps of ``tokens [B, k]``: its ``keep_drafting`` over each slot's
        confidence (the drafter's probability of its token) in order, read in one sync; the token it stops
        after stays, as when it drafts token by token."""
        confidence = probabilities(logits, self.cfg).gather(-1, tokens[..., None])[..., 0]  # [B, k]
        flags = [self.policy.keep_drafting(confidence[:, j], active) for j in range(tokens.shape[1])]
        go = torch.stack(flags).tolist()
        return next((j + 1 for j, keep in enumerate(go) if not keep), len(go))

    def absorb(self, r: Round, tokens: torch.Tensor, lengths: list[int], source: str) -> Draft:
        """A chain's first stage drafted: no drafter pass (``update`` still writes the kept tokens' context)."""
        probs = None if self.cfg.greedy else one_hot(tokens, self.m.vocab_size)
        return Draft(tokens, probs, list(lengths), sources=[source] * len(lengths))

    def retire(self) -> None:
        """A chain stopped its drafts for the rest of the call: the context is not kept any more."""
        self.retired, self.context = True, None

    def update(self, r: Round, draft: Draft, verdict: Verdict, done) -> None:
        """The context of the kept tokens ``[t, d1..d_kept]`` at slots ``r.start..``, from the features the
        verification captured (holes where a row kept fewer than the longest, and for rows not decoding, as
        in the target's cache): the context then has the target cache's length."""
        if self.retired:
            return
        device = r.last.device
        longest = max(done.kept)
        offsets = torch.arange(longest + 1, device=device)
        kept = torch.tensor(done.kept, device=device)
        valid = (offsets[None, :] <= kept[:, None]) & r.active[:, None]
        positions = self.clamped(r.positions[:, None] + offsets)
        self.context.write(draft.features[:, : longest + 1], positions, valid)

    # -- costs --------------------------------------------------------------------------------------------
    def token_cost(self) -> float:
        return 0.0  # a round's drafts cost one pass, whatever their number: ``round_cost``

    def ride_cost(self) -> float:
        return self.write_cost  # a round the first stage drafted: the kept tokens' context write

    def round_cost(self, drafted: int) -> float:
        return block_round_cost(self.costs, drafted, self.pass_cost, self.write_cost)
