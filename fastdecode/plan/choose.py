"""What pays on a model: the exit and draft length a checkpoint recommends (``choose_exit``) and the plan of
lossless decoders ``auto`` runs (``plan_decoding``), both from the cost model (``fastdecode/plan/cost.py``)
and the acceptance a checkpoint records (``fastdecode/plan/acceptance.py``).

The plan prices what each kind in ``fastdecode.decoding.kinds.PROPOSERS`` offers, ranks the candidates by
expected speedup (prompt lookup alone, lookup chained before a drafter that pays, a drafter alone) and
reports the drafters not expected to pay in ``not_paying``. How candidates are formed: docs/design/plan.md.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from fastdecode.decoding.kinds import PROPOSERS, Offer, PlanInputs, ProposerKind
from fastdecode.files.file_cache import file_identity
from fastdecode.plan.acceptance import AcceptanceRecord
from fastdecode.plan.cost import CostModel, exit_draft_cost, expected_tokens
from fastdecode.runtime.model import EarlyExitModel

MAX_DRAFT = 8  # the longest draft considered
MIN_SPEEDUP = 1.05  # a drafter is planned (an exit recommended) only if the cost model expects at least this
# the most tokens a prompt-lookup draft may have, alone or in a chain (the cost-aware cut shortens each one):
# the bound LOOKUP_PRIOR was measured at
LOOKUP_DRAFT = 6
# Every option a candidate sets, so that nothing else (a checkpoint's defaults) can change what was priced.
PLAN_OWNED = ("exit_layer", "adapter", "draft_vocab", "chain", "policy", "draft_tokens")
LOOKUP_OPTIONS = {
    "exit_layer": None,
    "adapter": None,
    "draft_vocab": None,
    "chain": False,
    "policy": "adaptive",
    "draft_tokens": LOOKUP_DRAFT,
}


@dataclass(frozen=True)
class LookupPrior:
    """Prompt lookup's rounds on text it was not tuned on: the share of rounds with a draft (``drafted``), the
    tokens such a round yields (``tokens``, the verifier's own included) and the tokens it drafts
    (``width``), with the adaptive cut at up to ``limit`` drafts (``policy="adaptive", draft_tokens=limit``:
    what every candidate drafting by lookup runs). Measured by replaying SmolLM2-135M-Instruct's greedy
    answers to ShareGPT training prompts (``fastdecode-lookup-replay``, docs/BENCHMARKS.md) under the 1-thread
    cost model of a quiet machine: the adaptive cut drafts longer where verification is cheaper, so ``width``
    belongs to that cost model."""

    drafted: float
    tokens: float
    width: float
    limit: int

    def speedup(self, costs: CostModel, fallback: float = 1.0, ride: float = 0.0) -> float:
        """Expected speedup over plain decoding; with a ``fallback`` drafter (its own speedup) drafting the
        rounds without a lookup draft (a chain): those rounds' tokens then take 1/fallback of the time, and
        the lookup rounds ``ride`` more (what the fallback drafter costs there, ``Offer.ride_cost``)."""
        q = self.drafted
        tokens = q * self.tokens + (1 - q)
        return tokens / (q * (costs.verify(round(self.width) + 1) + ride) + (1 - q) / fallback)


LOOKUP_PRIOR = LookupPrior(drafted=0.486, tokens=1.964, width=4.386, limit=LOOKUP_DRAFT)


def tokens_per_round(offer: Offer, k: int) -> float:
    """Tokens a round of ``k`` drafts yields: replayed when recorded, else i.i.d. from the acceptance."""
    if k in offer.tokens_per_round:
        return offer.tokens_per_round[k]
    return expected_tokens([offer.acceptance or 0.0] * k)


def price(offer: Offer, costs: CostModel, max_draft: int = MAX_DRAFT) -> tuple[int, float]:
    """``(K, expected speedup)`` of ``offer`` alone at the draft length with the most tokens per cost."""
    best = (0, 0.0)
    for k in range(1, max_draft + 1):
        speedup = tokens_per_round(offer, k) / offer.cost(costs, k)
        if speedup > best[1]:
            best = (k, speedup)
    return best


def choose_exit(
    agreement: dict[int, float],
    costs: CostModel,
    *,
    draft_costs: dict[int, float] | None = None,
    rounds: dict[int, dict[int, float]] | None = None,
    max_draft: int = MAX_DRAFT,
    min_speedup: float = MIN_SPEEDUP,
) -> dict:
    """The exit E and draft length K with the best expected self-speculation speedup.

    ``agreement[E]``: the greedy acceptance of drafts from exit E; ``rounds[E][K]``: the tokens a round of K
    drafts yields there, replayed (``fastdecode.plan.acceptance``; else i.i.d. from the agreement);
    ``draft_costs[E]``: one drafted token's cost at E in plain steps (``exit_draft_cost``; default: E blocks
    and the full head). Returns ``exit: None`` when no exit is expected to gain ``min_speedup``, with the best
    pair found (even a slowdown) as ``best_found``; ``costs`` says which cost model decided.
    """
    best = {"exit": None, "draft": 0, "expected_speedup": 0.0}
    for exit_, alpha in agreement.items():
        exit_ = int(exit_)
        if not 1 <= exit_ < costs.num_layers:
            continue
        token = (draft_costs or {}).get(exit_, costs.draft_token(exit_))
        found = (rounds or {}).get(exit_) or {}
        offer = Offer("exit", {}, float(alpha), token, exit_, exit_, {int(k): v for k, v in found.items()})
        k, speedup = price(offer, costs, max_draft)
        if speedup > best["expected_speedup"]:
            best = {"exit": exit_, "draft": k, "expected_speedup": speedup}
    if best["expected_speedup"] < min_speedup:
        best = {"exit": None, "draft": 0, "expected_speedup": 1.0, "best_found": best}
    return best | {"costs": costs.source}


def adapter_draft_costs(costs: CostModel, m: EarlyExitModel, adapters: dict, vocab=None) -> dict[int, float]:
    """Per exit E of ``adapters`` (E -> ``ExitAdapter``), one token drafted through the adapter over the draft
    vocabulary ``vocab`` (ids, or None for the full head)."""
    return {e: exit_draft_cost(costs, m, e, adapter=a, vocab=vocab) for e, a in adapters.items()}


@dataclass
class Candidate:
    """A lossless decoder the plan runs: ``method`` (a decoder name) with ``options`` (``DecodeConfig``
    fields: every one it was priced with), its ``expected_speedup`` over plain decoding (None: no prior is
    recorded for what it runs, ``with_corpus``), and what it drafts with (``drafter``, ``exit_layer``, the
    recorded ``acceptance`` and the priced draft length ``draft``)."""

    name: str
    method: str
    options: dict
    expected_speedup: float | None
    reason: str
    drafter: str = "prompt_lookup"
    exit_layer: int | None = None
    acceptance: float | None = None
    draft: int | None = None


@dataclass
class Plan:
    candidates: list[Candidate]
    not_paying: list[dict] = field(default_factory=list)  # drafters not expected to pay, with their numbers

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def to_json(self) -> dict:
        return {"candidates": [asdict(c) for c in self.candidates], "not_paying": self.not_paying}


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """``candidates`` by expected speedup, best first; those without one (no prior recorded) last."""
    return sorted(candidates, key=lambda c: (c.expected_speedup is None, -(c.expected_speedup or 0.0)))


def plan_files(*paths: str | os.PathLike | None) -> tuple:
    """``file_identity`` (resolved path, size, mtime_ns) of what a plan reads from ``paths`` beside the model's
    own record: a directory's files (a drafter's ``acceptance.json``, config, weights), a file itself; a
    missing path or None is skipped. A plan kept under it is made again once one of them is rewritten."""
    files: list[Path] = []
    for path in (Path(p) for p in paths if p):
        if path.is_dir():
            files += sorted(f for f in path.iterdir() if f.is_file())
        elif path.is_file():
            files.append(path)
    return file_identity(files)


def _lookup(costs: CostModel) -> Candidate:
    speedup = LOOKUP_PRIOR.speedup(costs)
    reason = (
        "free drafts from the row's own text; a row with no match pays nothing (priced by LOOKUP_PRIOR: "
        f"the adaptive cut at up to {LOOKUP_PRIOR.limit} drafts, as it runs)"
    )
    return Candidate("prompt_lookup", "prompt_lookup", dict(LOOKUP_OPTIONS), speedup, reason)


SUFFIX_DRAFT = 8  # the most tokens a suffix draft may have (configs/decoder/suffix.yaml: what was measured)


def with_corpus(candidate: Candidate, corpus: str) -> Candidate:
    """``candidate`` drafting by suffix decoding over ``corpus`` (a suffix index file) where it drafts by
    prompt lookup: alone, the ``suffix`` decoder; in a chain, its first stage (``decoder.suffix.first``).
    Other candidates are returned as they are. Why: with a corpus of the model's own answers, suffix decoding
    drafted at least as well as prompt lookup on every measured prompt set (1.00-1.40x of it, one thread;
    docs/BENCHMARKS.md, issue 27); without one it did not on open chat, so a plan without a corpus keeps
    prompt lookup. Its ``expected_speedup`` is None: no prior is recorded for suffix decoding over a corpus
    (prompt lookup's would price another drafter)."""
    unpriced = "no prior is recorded for suffix decoding over a corpus: no expected speedup"
    if candidate.method == "prompt_lookup":
        options = candidate.options | {"draft_tokens": SUFFIX_DRAFT, "suffix": {"corpus": corpus}}
        reason = (
            f"free drafts from the row's text, earlier outputs and the corpus (suffix decoding); {unpriced}"
        )
        return replace(
            candidate,
            name="suffix",
            method="suffix",
            options=options,
            expected_speedup=None,
            reason=reason,
            drafter="suffix",
        )
    if candidate.options.get("chain"):
        options = candidate.options | {"suffix": {"first": True, "corpus": corpus}}
        name = candidate.name.replace("prompt_lookup+", "suffix+", 1)
        reason = f"suffix decoding first; {candidate.reason}; {unpriced}"
        return replace(candidate, name=name, options=options, expected_speedup=None, reason=reason)
    return candidate


def draft_bound(kind: ProposerKind) -> int:
    """The longest draft ``kind``'s offers are priced over: what its candidate may draft. A chainable kind runs
    in a chain whose draft length bound is the one prompt lookup's prior was measured at
    (``LOOKUP_PRIOR.limit``); a kind alone, any K up to ``MAX_DRAFT`` (it runs the K priced)."""
    return LOOKUP_PRIOR.limit if kind.chainable else MAX_DRAFT


def _candidate(kind: ProposerKind, offer: Offer, costs: CostModel, k: int, alone: float) -> Candidate:
    """The candidate that runs ``offer``: chained after prompt lookup when the kind can be, else alone."""
    acceptance = f"acceptance {offer.acceptance:.2f}" + (
        f" at E={offer.exit_layer}" if offer.exit_layer else ""
    )
    if kind.chainable:
        bound = draft_bound(kind)  # the chain drafts as the prior was measured, and the fallback was priced
        options = offer.options | {"chain": True, "policy": "adaptive", "draft_tokens": bound}
        speedup = LOOKUP_PRIOR.speedup(costs, fallback=alone, ride=offer.ride_cost)
        reason = (
            f"prompt lookup, else {offer.drafter} ({acceptance}: {alone:.2f}x alone at its best constant K={k} "
            f"of 1..{bound}); priced with LOOKUP_PRIOR (the adaptive cut at up to {bound} drafts) and run "
            f"adaptive at up to {bound} drafts"
        )
        name = f"prompt_lookup+{offer.drafter.split(' ')[0]}"
    else:
        options = offer.options | {"chain": False, "policy": "constant", "draft_tokens": k}
        speedup, name = alone, offer.drafter
        reason = f"{offer.drafter} ({acceptance}, priced and run at constant K={k})"
    options = {key: options.get(key, LOOKUP_OPTIONS[key]) for key in PLAN_OWNED} | options
    return Candidate(
        name, kind.name, options, speedup, reason, offer.drafter, offer.exit_layer, offer.acceptance, k
    )


def _priced(offers: list[tuple[ProposerKind, Offer]], costs: CostModel, plan: Plan) -> None:
    """Add the best paying offer per drafter to ``plan``; note the best of each that does not pay."""
    best: dict[str, tuple[float, int, ProposerKind, Offer]] = {}
    for kind, offer in offers:
        if offer.acceptance is None:
            plan.not_paying.append(
                {"drafter": offer.drafter, "exit": offer.exit_layer, "reason": "no acceptance recorded"}
            )
            continue
        k, speedup = price(offer, costs, draft_bound(kind))
        if offer.drafter not in best or speedup > best[offer.drafter][0]:
            best[offer.drafter] = (speedup, k, kind, offer)
    for drafter, (speedup, k, kind, offer) in best.items():
        if speedup >= MIN_SPEEDUP:
            plan.candidates.append(_candidate(kind, offer, costs, k, speedup))
            continue
        plan.not_paying.append(
            {
                "drafter": drafter,
                "exit": offer.exit_layer,
                "acceptance": offer.acceptance,
                "draft": k,
                "expected_speedup": speedup,
            }
        )


def plan_decoding(
    m: EarlyExitModel,
    costs: CostModel,
    *,
    record: AcceptanceRecord | None = None,
    adapter: str | None = None,
    drafter: str | None = None,
) -> Plan:
    """The lossless decoders expected to pay on ``m`` (docs/design/plan.md), best first.

    ``record``: what the checkpoint records (``fastdecode.plan.acceptance.read_record``); ``adapter``: an exit
    adapter directory given with the model (its own record beside it); ``drafter``: an EAGLE-3 head directory
    (its ``acceptance.json`` beside it). ``costs``: the cost model at the
    batch size the plan is for.
    """
    inputs = PlanInputs(m, costs, record, adapter, drafter)
    offers = [(kind, offer) for kind in PROPOSERS.values() if kind.offers for offer in kind.offers(inputs)]
    plan = Plan([_lookup(costs)])
    _priced(offers, costs, plan)
    plan.candidates = ranked(plan.candidates)
    return plan
