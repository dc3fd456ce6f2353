"""What the speed benchmark resolves once the target model is loaded, with its measured cost model.

``draft_tokens: auto`` becomes a constant K when the acceptance the checkpoint records says some K pays, else
the adaptive policy with K <= ``AUTO_DRAFT_CAP`` (``resolve_draft_tokens``). The ``auto`` method becomes one
row that is ``generate(method="auto")`` itself and one row per candidate of the plan, ``auto:<candidate>``
(``expand_auto``). Nothing here runs when no selected method needs it. Details: docs/design/bench.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fastdecode.api import FastDecoder
from fastdecode.bench.config import (
    AUTO,
    AUTO_DRAFT_CAP,
    Method,
    SpeedJob,
    check_options,
    job_drafters,
    resolve_adapter_path,
)
from fastdecode.decoding.draft_vocab import draft_vocab_ids
from fastdecode.drafters.exits.adapter import load_adapter
from fastdecode.drafters.exits.record import recorded_adapter
from fastdecode.plan.acceptance import read_record
from fastdecode.plan.choose import Plan, choose_exit, with_corpus
from fastdecode.plan.cost import CostModel, decoding_costs, exit_draft_cost
from fastdecode.runtime.model import EarlyExitModel

AUTO_PREFIX = "auto:"  # the names of the auto method's candidates: auto:<candidate.name>


@dataclass
class Resolved:
    """The methods to run (``auto``'s candidates added), the plan, the cost model that decided (None: not
    needed) and the library facade the ``auto`` row calls."""

    methods: list[Method]
    plan: Plan | None = None
    costs: CostModel | None = None
    decoder: FastDecoder | None = None


def _recorded(method: Method, job: SpeedJob, m: EarlyExitModel, costs: CostModel) -> tuple:
    """``(acceptance, tokens per round by K, one drafted token's cost)`` at the method's drafter for
    ``draft_tokens: auto``: an adapter's own record, else the checkpoint's record at E with the method's head
    (its draft vocabulary or the full head). ``(None, {}, 0.0)`` when nothing is recorded there."""
    options, exit_layer = method.options, method.exit_layer
    if options.get("adapter") is not None:
        found = recorded_adapter(options["adapter"])
        adapter, _, vocab = load_adapter(found.path, m)
        cost = exit_draft_cost(costs, m, found.exit_layer, adapter=adapter, vocab=vocab)
        return found.agreement, found.tokens_per_round, cost
    record = read_record(job.checkpoint)
    if exit_layer is None or record is None:
        return None, {}, 0.0
    vocab = draft_vocab_ids(options.get("draft_vocab"), m)
    wanted = None if vocab is None else len(vocab)
    for d in record.find("exit"):
        head = draft_vocab_ids(record.path_of(d.draft_vocab), m) if d.draft_vocab else None
        if d.exit_layer == exit_layer and (None if head is None else len(head)) == wanted:
            return d.acceptance, d.tokens_per_round, exit_draft_cost(costs, m, exit_layer, vocab=vocab)
    return None, {}, 0.0


def resolve_draft_tokens(method: Method, job: SpeedJob, m: EarlyExitModel, costs: CostModel) -> None:
    """``draft_tokens: auto`` of ``method`` (docs/design/bench.md): rewrites its options (``policy``,
    ``draft_tokens``) and sets ``draft_source``; a fixed K is left untouched."""
    options, exit_layer = method.options, method.exit_layer
    if options.get("draft_tokens") != AUTO:
        return
    alpha, rounds, token = _recorded(method, job, m, costs)
    if alpha is not None and exit_layer is not None:
        choice = choose_exit(
            {exit_layer: alpha},
            costs,
            draft_costs={exit_layer: token},
            rounds={exit_layer: rounds},
            max_draft=AUTO_DRAFT_CAP,
        )
        if choice["exit"] is not None:
            options.update(policy="constant", draft_tokens=int(choice["draft"]))
            method.draft_source = (
                f"cost model ({costs.source}): recorded acceptance {alpha:.2f} at E={exit_layer} -> "
                f"K={choice['draft']} (expected {choice['expected_speedup']:.2f}x)"
            )
            return
        best = choice["best_found"]
        reason = (
            f"recorded acceptance {alpha:.2f} at E={exit_layer}: no constant K is expected to pay "
            f"({costs.source} cost model; best K={best['draft']}, {best['expected_speedup']:.2f}x)"
        )
    else:
        reason = "no acceptance recorded for this exit and head"
    options.update(policy="adaptive", draft_tokens=AUTO_DRAFT_CAP)
    method.draft_source = f"adaptive, K <= {AUTO_DRAFT_CAP} ({reason})"


def expand_auto(method: Method, plan: Plan) -> list[Method]:
    """The ``auto`` method itself, then one method per candidate of ``plan``, named ``auto:<candidate>``, over
    the ``auto`` method's own options (engine settings, ``costs``); each checked like a configured method."""
    expanded = [method]
    for candidate in plan.candidates:
        name = f"{AUTO_PREFIX}{candidate.name}"
        options = dict(method.options) | candidate.options
        spec = dataclasses.replace(
            method.spec,
            decoder=candidate.method,
            uses_adapter=candidate.options.get("adapter") is not None,
            uses_corpus=bool((candidate.options.get("suffix") or {}).get("corpus")),
            options=options,
            description=candidate.reason,
        )
        check_options(name, spec, options)
        exit_layer = candidate.exit_layer
        expanded.append(Method(name, spec, options, exit_layer, candidate=dataclasses.asdict(candidate)))
    return expanded


def auto_decoder(job: SpeedJob, m: EarlyExitModel, tokenizer: Any) -> FastDecoder:
    """The library facade ``generate(method="auto")`` runs on, around the loaded model (one wrapper: the
    engine and the cost model are shared with every other method)."""
    return FastDecoder(
        m.hf,
        tokenizer,
        directory=None,
        adapter=resolve_adapter_path(job),
        record=read_record(job.checkpoint),
        drafter=(job_drafters(job) or [None])[0],  # several: ``auto`` plans with the first
        m=m,
    )


def resolve_after_load(job: SpeedJob, methods: list[Method], m: EarlyExitModel, tokenizer: Any) -> Resolved:
    """``draft_tokens: auto`` and the ``auto`` method of ``methods`` on the loaded target ``m``."""
    auto_k = [x for x in methods if x.options.get("draft_tokens") == AUTO]
    if not auto_k and not any(x.is_auto for x in methods):
        return Resolved(methods)
    costs = decoding_costs(m)
    for method in auto_k:
        resolve_draft_tokens(method, job, m, costs)
    resolved = Resolved([], costs=costs)
    for method in methods:
        if not method.is_auto:
            resolved.methods.append(method)
            continue
        resolved.decoder = resolved.decoder or auto_decoder(job, m, tokenizer)
        resolved.plan = resolved.decoder.plan(1, **method.options)
        if job.corpus:  # suffix decoding over the corpus where the plan drafts by prompt lookup
            found = resolved.plan
            resolved.plan = Plan([with_corpus(c, job.corpus) for c in found.candidates], found.not_paying)
        resolved.methods += expand_auto(method, resolved.plan)
    return resolved
