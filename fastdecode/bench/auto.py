"""What the speed benchmark resolves once the target model is loaded, with its measured cost model
(``fastdecode/cost.py``, ``decoding_costs``: the device's default engine, measured once per model, engine and
thread count):

- ``draft_tokens: auto`` (``configs/decoder/self_speculative.yaml``): ``choose_exit({E: alpha}, costs)`` with the
  acceptance alpha at E the checkpoint records (``exit_report.json``; an exit adapter's own recorded agreement
  when the method drafts through one) gives a constant K when some K is expected to pay; otherwise the
  adaptive policy with K <= ``AUTO_DRAFT_CAP``. ``Method.draft_source`` says which and why.
- the ``auto`` method (``configs/decoder/auto.yaml``): ``fastdecode.choose.plan_decoding`` on the model, the
  checkpoint's recorded acceptance and the job's exit adapter (when one resolves), expanded into one method per
  candidate, ``auto:<candidate>`` (``auto:prompt_lookup+exit``, ``auto:prompt_lookup``), best expected first.

Nothing here runs (and no cost model is measured) when no selected method needs it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from fastdecode.bench.config import (
    AUTO,
    AUTO_DRAFT_CAP,
    Method,
    SpeedJob,
    check_options,
    resolve_adapter_path,
)
from fastdecode.checkpoint_info import recorded_acceptance
from fastdecode.choose import Plan, choose_exit, plan_decoding, recorded_adapter
from fastdecode.cost import CostModel, decoding_costs, exit_draft_cost
from fastdecode.draft_vocab_file import load_draft_vocab
from fastdecode.exit_adapter import load_adapter
from fastdecode.model import EarlyExitModel

AUTO_PREFIX = "auto:"  # the names of the auto method's candidates: auto:<candidate.name>


@dataclass
class Resolved:
    """The methods to run (``auto`` expanded), its plan, and the cost model that decided (None: not needed)."""

    methods: list[Method]
    plan: Plan | None = None
    costs: CostModel | None = None


def _recorded(
    method: Method, m: EarlyExitModel, costs: CostModel, acceptance: dict[int, float] | None
) -> tuple[float | None, float]:
    """``(acceptance at the method's exit or None, one drafted token's cost)`` for ``draft_tokens: auto``: an
    adapter's own recorded agreement and cost, else the checkpoint's acceptance at E and the raw exit's cost
    (over the draft vocabulary when the method has one)."""
    options, exit_layer = method.options, method.exit_layer
    if options.get("adapter") is not None:
        found = recorded_adapter(options["adapter"])
        adapter, _, vocab = load_adapter(found.path, m)
        return found.agreement, exit_draft_cost(costs, m, found.exit_layer, adapter=adapter, vocab=vocab)
    if exit_layer is None:
        return None, 0.0
    vocab = None
    if options.get("draft_vocab") and Path(options["draft_vocab"]).is_file():  # else the decoder names it
        vocab = load_draft_vocab(options["draft_vocab"])[0]
    return (acceptance or {}).get(exit_layer), exit_draft_cost(costs, m, exit_layer, vocab=vocab)


def resolve_draft_tokens(
    method: Method, m: EarlyExitModel, costs: CostModel, acceptance: dict[int, float] | None
) -> None:
    """``draft_tokens: auto`` of ``method`` (see the module docstring): rewrites its options (``policy``,
    ``draft_tokens``) and sets ``draft_source``; a fixed K is left untouched."""
    options, exit_layer = method.options, method.exit_layer
    if options.get("draft_tokens") != AUTO:
        return
    alpha, token = _recorded(method, m, costs, acceptance)
    if alpha is not None and exit_layer is not None:
        choice = choose_exit(
            {exit_layer: alpha}, costs, draft_costs={exit_layer: token}, max_draft=AUTO_DRAFT_CAP
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
        reason = "no acceptance recorded for this exit"
    options.update(policy="adaptive", draft_tokens=AUTO_DRAFT_CAP)
    method.draft_source = f"adaptive, K <= {AUTO_DRAFT_CAP} ({reason})"


def expand_auto(method: Method, plan: Plan) -> list[Method]:
    """One method per candidate of ``plan``, named ``auto:<candidate>``, over the ``auto`` method's own options
    (engine settings, ``costs``); each checked like a configured method."""
    expanded = []
    for candidate in plan.candidates:
        name = f"{AUTO_PREFIX}{candidate.name}"
        options = dict(method.options) | candidate.options
        spec = dataclasses.replace(
            method.spec,
            decoder=candidate.method,
            uses_adapter="adapter" in candidate.options,
            options=options,
            description=candidate.reason,
        )
        check_options(name, spec, options)
        exit_layer = options.get("exit_layer")
        if options.get("adapter") is not None:
            exit_layer = recorded_adapter(options["adapter"]).exit_layer
        expanded.append(Method(name, spec, options, exit_layer, candidate=dataclasses.asdict(candidate)))
    return expanded


def resolve_after_load(job: SpeedJob, methods: list[Method], m: EarlyExitModel) -> Resolved:
    """``draft_tokens: auto`` and the ``auto`` method of ``methods`` on the loaded target ``m``."""
    auto_k = [x for x in methods if x.options.get("draft_tokens") == AUTO]
    if not auto_k and not any(x.is_auto for x in methods):
        return Resolved(methods)
    costs = decoding_costs(m)
    acceptance = recorded_acceptance(job.checkpoint)
    for method in auto_k:
        resolve_draft_tokens(method, m, costs, acceptance)
    resolved = Resolved([], costs=costs)
    for method in methods:
        if not method.is_auto:
            resolved.methods.append(method)
            continue
        if resolved.plan is None:
            adapter = resolve_adapter_path(job)
            resolved.plan = plan_decoding(
                m,
                costs,
                exit_agreement=acceptance,
                adapter=recorded_adapter(adapter) if adapter else None,
            )
        resolved.methods += expand_auto(method, resolved.plan)
    return resolved
