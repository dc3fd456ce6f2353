"""Kinds of draft: how the one speculative loop builds, checks, chains and plans each drafter.

A ``ProposerKind`` is everything fastdecode needs to know about a kind of drafter besides its ``Proposer``
class (``proposers.py``): its decoder name, its own checks (run before the execution engine is configured),
how to build its proposer for a call, whether it can follow prompt lookup (or suffix decoding, with
``decoder.suffix.first``: ``FIRST_STAGES``) in a chain (``decoder.chain``), and
what it offers ``auto`` (``offers``: the drafters it can run on a model, priced from what the model's
checkpoint records). ``PROPOSERS`` in ``fastdecode/decoding/__init__.py`` registers the kinds; each one is also
a decoder (``generate``), so a new drafter is its module (a ``Proposer`` and its ``ProposerKind``), one line in
``PROPOSERS`` and a ``configs/decoder/<name>.yaml``.

What an offer says: the ``DecodeConfig`` options that make the kind draft with it (complete: what the plan
prices is exactly what runs), the acceptance it records (per token, and per draft length replayed on the
model's own answers when recorded: ``fastdecode/acceptance.py``), and its cost per drafted token and per
round in plain decoding steps (``fastdecode/cost.py``). ``fastdecode/choose.py`` turns offers into a plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdecode.acceptance import AcceptanceRecord
from fastdecode.config import ConfigError
from fastdecode.cost import CostModel, cost_model
from fastdecode.decoding.chain import ChainProposer, FirstStage, carried_books
from fastdecode.decoding.common import (
    DecodeConfig,
    DecodeOutput,
    check,
    configure_engine,
    new_generator,
    refuse_draft_model,
)
from fastdecode.decoding.ngram import PromptLookupProposer, refuse_tree
from fastdecode.decoding.proposers import Proposer
from fastdecode.decoding.speculative import speculate
from fastdecode.decoding.suffix_sources import corpus_of
from fastdecode.model import EarlyExitModel


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


def lookup_first(s: Setup) -> FirstStage:
    return PromptLookupProposer(s.prompts, s.cfg, s.costs, s.m.vocab_size)


# A chain's first stages by name: prompt lookup here; ``fastdecode/decoding/__init__.py`` adds ``suffix``
# (whose module imports this one). ``first_stage`` picks one from ``decoder.suffix.first``.
FIRST_STAGES: dict[str, Callable[[Setup], FirstStage]] = {"prompt_lookup": lookup_first}


def first_stage(cfg: DecodeConfig) -> str:
    return "suffix" if cfg.suffix.first else "prompt_lookup"


def check_first(m: EarlyExitModel, cfg: DecodeConfig, name: str) -> None:
    """Refuse ``decoder.suffix.first`` outside a chain or with token trees (the model drafters that follow
    draft chains), and a bad corpus file, before any work."""
    if not cfg.suffix.first:
        return
    if not cfg.chain:
        raise ConfigError(
            f"decoder.suffix.first=true puts suffix decoding first in a chain: set decoder.chain=true (with "
            f"'self_speculative', 'assisted' or 'eagle3'), or decoder.suffix.first=false (decoder '{name}')."
        )
    if cfg.suffix.tree:
        raise ConfigError(
            "decoder.suffix.tree=true: a chain's first stage drafts chains only (the drafter that follows "
            "drafts chains); set decoder.suffix.tree=false with decoder.suffix.first=true."
        )
    corpus_of(m, cfg.suffix, cfg.eos_ids)


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
        if cfg.chain:
            refuse_tree(f"decoder '{self.name}' with decoder.chain=true", cfg)
        check_first(m, cfg, self.name)
        self.check(m, prompts, cfg, draft)

    def proposer(
        self, m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, generator, draft: Any = None
    ) -> Proposer:
        """The call's proposer, chained after prompt lookup (or suffix decoding: ``decoder.suffix.first``)
        with ``cfg.chain`` (``chain.ChainProposer``), priced by the target's cost model at the call's batch
        size. After ``validate``."""
        costs = cost_model(m, cfg.costs, batch=len(prompts))
        setup = Setup(m, prompts, cfg, generator, costs, draft)
        proposer = self.build(setup)
        if cfg.chain:
            lookup = FIRST_STAGES[first_stage(cfg)](setup)
            judge_after = cfg.lookup.fallback_trial
            proposer = ChainProposer(lookup, proposer, judge_after=judge_after, books=carried_books())
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
