"""The exit drafter: the target's first E layers and its shared exit head (or an exit adapter at E) draft in
the target's own cache; the rest of the model verifies (self-speculative decoding)."""

from __future__ import annotations

from typing import Any

import torch

from fastdecode.decoding.common import Prefill, prefill
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.proposers import ModelProposer
from fastdecode.decoding.speculative import Draft
from fastdecode.plan.cost import CostModel, exit_draft_cost
from fastdecode.runtime.model import EarlyExitModel


class ExitProposer(ModelProposer):
    """Self-speculation: layers ``< E`` of the target (``E = exit_layer``) and the shared exit head, in the
    target's cache; with ``adapter`` (an ``ExitAdapter`` at E) the head reads its output over ``vocab``."""

    name = "exit"

    def __init__(
        self,
        m: EarlyExitModel,
        exit_layer: int,
        cfg: DecodeConfig,
        generator: torch.Generator,
        *,
        costs: CostModel,
        adapter: Any = None,
        vocab: torch.Tensor | None = None,
    ) -> None:
        super().__init__(m, exit_layer, cfg, generator)
        self.adapter, self.vocab, self.costs, self.depth = adapter, vocab, costs, exit_layer
        if adapter is not None:
            self.name = "adapter"

    def start(self, m: EarlyExitModel, prompts: list[list[int]], capacity: int) -> Prefill:
        state = prefill(m, prompts, capacity, adapter=self.adapter)
        self.cache = state.cache
        return state

    def token_cost(self) -> float:
        return exit_draft_cost(self.costs, self.model, self.depth, adapter=self.adapter, vocab=self.vocab)

    def _draft(self, tokens, probs, hidden, *, layers_run: int, layer_calls: int, sources=None) -> Draft:
        return Draft(tokens, probs, None, hidden, self.depth, sources, layers_run, layer_calls)
