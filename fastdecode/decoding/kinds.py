"""Kinds of draft: how the one speculative loop builds, checks, chains and plans each drafter.

A ``ProposerKind`` is what the loop knows of a drafter besides its ``Proposer``: its decoder name, its checks,
how to build its proposer for a call, whether it can follow a chain's first stage, and what it offers ``auto``
(``Offer``: options, recorded acceptance, cost). ``PROPOSERS`` and ``FIRST_STAGES`` are plugin tables that
``fastdecode.registry`` fills; the loop imports no drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdecode.config import ConfigError
from fastdecode.decoding.chain import ChainProposer, FirstStage, carried_books
from fastdecode.decoding.common import check, configure_engine, new_generator, refuse_draft_model
from fastdecode.decoding.config import DecodeConfig, DecodeOutput
from fastdecode.decoding.proposers import Proposer
from fastdecode.decoding.speculative import speculate
from fastdecode.plan.acceptance import AcceptanceRecord
from fastdecode.plan.cost import CostModel, cost_model
from fastdecode.runtime.model import EarlyExitModel


@dataclass
class Setup:
    """What a proposer is built from in one call: the target, the prompts, the config, the call's generator,
    the target's cost model at the call's batch size and the separate draft model (two-model kinds)."""

    m: EarlyExitModel
    prompts: list[list[int]]
    cfg: DecodeConfig
    generator: torch.Generator
    costs: CostModel
    draft: EarlyExitModel | None = None


@dataclass
class PlanInputs:
    """What ``auto`` plans from: the target, its cost model, the acceptance its checkpoint records (None:
    none), an exit adapter directory given with it (None: none) and an EAGLE-3 head directory (None: none)."""

    m: EarlyExitModel
    costs: CostModel
    record: AcceptanceRecord | None = None
    adapter: str | None = None
    drafter: str | None = None


@dataclass
class Offer:
    """A drafter a kind can run on the model, with what prices it. ``options``: the ``DecodeConfig`` fields
    that select it (every field the price depends on, so nothing else may be merged in); ``acceptance``: per
    drafted token (None: not recorded, not plannable); ``tokens_per_round``: per draft length K, the tokens a
    round yields, replayed exactly (empty: i.i.d. from ``acceptance``); ``token_cost``: one drafted token and
    ``depth``: the target blocks its drafts leave run, both for ``CostModel.round_cost``; ``round_cost``:
    a kind whose rounds are priced otherwise (a separate draft model) sets it; ``ride_cost``: what the
    drafter costs in a chain's round that prompt lookup drafted (an EAGLE-3 head still writes its rows for
    the kept tokens), in plain decoding steps."""

    drafter: str
    options: dict
    acceptance: float | None
    token_cost: float
    depth: int = 0
    exit_layer: int | None = None
    tokens_per_round: dict[int, float] = field(default_factory=dict)
    round_cost: Callable[[int], float] | None = None
    ride_cost: float = 0.0

    def cost(self, costs: CostModel, drafted: int) -> float:
        """A round of ``drafted`` tokens and their verification, in plain decoding steps."""
        if self.round_cost is not None:
            return self.round_cost(drafted)
        return costs.round_cost(drafted, self.token_cost, self.depth)


@dataclass(frozen=True)
class FirstStageKind:
    """A chain's first stage: ``build(setup)`` its ``FirstStage`` for a call; ``selects(cfg)``: whether the
    call asks for it in place of the default (``DEFAULT_FIRST``, prompt lookup)."""

    build: Callable[[Setup], FirstStage]
    selects: Callable[[DecodeConfig], bool]


DEFAULT_FIRST = "prompt_lookup"
# Plugin tables, filled by ``fastdecode.registry``: the kinds of drafter by decoder name, a chain's first stages.
PROPOSERS: dict[str, ProposerKind] = {}
FIRST_STAGES: dict[str, FirstStageKind] = {}


def first_stage(cfg: DecodeConfig) -> FirstStageKind:
    """The first stage a chain of ``cfg`` runs: the one the call selects, else the default."""
    chosen = [kind for name, kind in FIRST_STAGES.items() if name != DEFAULT_FIRST and kind.selects(cfg)]
    return chosen[0] if chosen else FIRST_STAGES[DEFAULT_FIRST]


def no_check(m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: Any) -> None:
    """The checks of a kind without a draft model or options of its own."""


@dataclass(frozen=True)
class ProposerKind:
    """A kind of drafter (see the module docstring). ``check(m, prompts, cfg, draft)`` raises a
    ``ConfigError`` for what the kind cannot do (``refuse_draft_model`` unless ``uses_draft_model``);
    ``build(setup)`` returns its proposer; ``offers(inputs)`` what ``auto`` may plan with it."""

    name: str
    build: Callable[[Setup], Proposer]
    check: Callable[[EarlyExitModel, list[list[int]], DecodeConfig, Any], None] = no_check
    chainable: bool = False
    uses_draft_model: bool = False
    offers: Callable[[PlanInputs], list[Offer]] | None = None

    def validate(
        self, m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: Any = None
    ) -> None:
        """Every check of a call, before any work (the engine included): changes nothing."""
        check(cfg, m, prompts)
        if not self.uses_draft_model:
            refuse_draft_model(self.name, draft)
        if cfg.chain and not self.chainable:
            raise ConfigError(
                f"decoder.chain=true: decoder '{self.name}' cannot follow prompt lookup in a chain; set "
                "decoder.chain=false, or use 'self_speculative' or 'assisted' with decoder.chain=true."
            )
        for options in cfg.groups.values():
            options.check_call(m, cfg, self.name)
        self.check(m, prompts, cfg, draft)

    def proposer(
        self, m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, generator, draft: Any = None
    ) -> Proposer:
        """The call's proposer, chained after its first stage with ``cfg.chain`` (``chain.ChainProposer``),
        priced by the target's cost model at the call's batch size. After ``validate``."""
        costs = cost_model(m, cfg.costs, batch=len(prompts))
        setup = Setup(m, prompts, cfg, generator, costs, draft)
        proposer = self.build(setup)
        if cfg.chain:
            first = first_stage(cfg).build(setup)
            proposer = ChainProposer(first, proposer, judge_after=first.trial, books=carried_books())
        return proposer

    def generate(
        self, m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: Any = None
    ) -> DecodeOutput:
        """Decode ``prompts`` with this kind's drafts verified by the speculative loop; lossless."""
        with torch.inference_mode():
            self.validate(m, prompts, cfg, draft)
            configure_engine(m, cfg)  # the execution engine this call decodes on (the checks changed nothing)
            if draft is not None:
                configure_engine(draft, cfg)
            generator = new_generator(cfg, m.device)
            proposer = self.proposer(m, prompts, cfg, generator, draft)
            out = speculate(m, prompts, cfg, proposer, generator=generator)
        proposer.finish(out)
        return out
