"""The draft-model drafter: a smaller model with the target's tokenizer drafts in its own cache (two-model
speculative decoding)."""

from __future__ import annotations

import torch

from fastdecode.decoding.common import Prefill, prefill
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.proposers import ModelProposer
from fastdecode.decoding.speculative import Draft
from fastdecode.plan.cost import CostModel
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.model import EarlyExitModel


class DraftModelProposer(ModelProposer):
    """Two-model speculation: every layer of ``draft`` (a smaller model, the target's tokenizer), in its own
    cache; ``draft_costs``: the draft model's cost model (its step in the target's unit via ``step_seconds``
    when both are measured, else by weights read)."""

    name = "draft_model"

    def __init__(
        self,
        draft: EarlyExitModel,
        cfg: DecodeConfig,
        generator: torch.Generator,
        *,
        costs: CostModel,
        draft_costs: CostModel,
        vocab: torch.Tensor | None = None,
        target: EarlyExitModel,
    ) -> None:
        super().__init__(draft, draft.num_layers, cfg, generator)
        self.costs, self.draft_costs, self.vocab, self.target = costs, draft_costs, vocab, target

    def start(self, m: EarlyExitModel, prompts: list[list[int]], capacity: int) -> Prefill:
        state = prefill(m, prompts, capacity)
        self.cache = prefill(self.model, prompts, capacity).cache
        return state

    def caches(self) -> list[KVCache]:
        return [self.cache]

    def _step_ratio(self) -> float:
        """The draft model's plain step in the target's."""
        if self.costs.step_seconds and self.draft_costs.step_seconds:
            return self.draft_costs.step_seconds / self.costs.step_seconds
        return self.model.step_cost() / self.target.step_cost()

    def token_cost(self) -> float:
        rows = None if self.vocab is None else len(self.vocab)
        return self._step_ratio() * self.draft_costs.draft_token(self.blocks, head_rows=rows)

    def round_cost(self, drafted: int) -> float:
        # the last draft's pass through the draft model (its cache must hold it), then the whole target
        last = self._step_ratio() * self.draft_costs.layers(self.blocks)
        return drafted * self.token_cost() + last + self.costs.verify(drafted + 1)

    def _draft(self, tokens, probs, hidden, *, layers_run: int, layer_calls: int, sources=None) -> Draft:
        return Draft(tokens, probs, None, None, 0, sources, layers_run, layer_calls)
