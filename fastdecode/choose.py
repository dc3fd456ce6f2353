"""What pays on a model: the exit and draft length (``choose_exit``) and the lossless decoders to run
(``plan_decoding``), both from the cost model (``fastdecode/cost.py``) and the acceptance a checkpoint records.

The LayerSkip and exit-adapter recipes choose their exit here, their closing speed lines run the plan,
``eval/exits.py`` recommends with it, ``eval/speed.py`` expands its ``auto`` method into the plan, and
``fastdecode.from_pretrained(...).generate`` decodes with the plan's first decoder by default.

The plan, in order of preference:

1. prompt lookup chained before the exit adapter or the exit, when a drafter at some exit is expected to gain
   ``min_speedup`` with the acceptance its checkpoint records (``chain``: a row drafts from the lookup when
   its text matches, from the exit otherwise);
2. prompt lookup alone: free to draft, and a row with no match pays nothing, so with the cost-aware policy it
   is never expected to lose; it gains where outputs copy their input.

An exit not expected to pay is reported in ``not_paying`` with its expected speedup, never chosen.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from fastdecode.cost import CostModel, exit_draft_cost, expected_tokens
from fastdecode.exit_adapter import INDEX_FILE, load_adapter, read_meta, resolve_adapter
from fastdecode.model import EarlyExitModel

MAX_DRAFT = 8  # the longest constant draft considered
MIN_SPEEDUP = 1.05  # an exit is chosen only if the cost model expects at least this
LOOKUP_DRAFT = 6  # the most tokens a prompt-lookup draft may have (the adaptive policy cuts each one)


def choose_exit(
    agreement: dict[int, float],
    costs: CostModel,
    *,
    draft_costs: dict[int, float] | None = None,
    max_draft: int = MAX_DRAFT,
    min_speedup: float = MIN_SPEEDUP,
) -> dict:
    """The exit E and draft length K with the best expected self-speculation speedup.

    ``agreement[E]``: the greedy acceptance of drafts from exit E (i.i.d. per position); ``draft_costs[E]``:
    one drafted token's cost at E in plain steps (``exit_draft_cost``; default: E blocks and the full head).
    A round of K drafts costs ``K * draft + verify(K + 1, from E)`` (``CostModel.round_cost``). Returns
    ``exit: None`` when no exit is expected to gain ``min_speedup`` (speculating would not pay), with the best
    pair found (even a slowdown) as ``best_found``; ``costs`` says which cost model decided.
    """
    best = {"exit": None, "draft": 0, "expected_speedup": 0.0}
    for exit_, alpha in agreement.items():
        exit_ = int(exit_)
        if not 1 <= exit_ < costs.num_layers:
            continue
        token = (draft_costs or {}).get(exit_, costs.draft_token(exit_))
        for k in range(1, max_draft + 1):
            speedup = expected_tokens([float(alpha)] * k) / costs.round_cost(k, token, exit_)
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
    """A lossless decoder the plan runs: ``method`` (a ``DECODERS`` name) with ``options`` (``DecodeConfig``
    fields); ``expected_speedup``: None where it depends on the text (n-gram drafting)."""

    name: str
    method: str
    options: dict
    expected_speedup: float | None
    reason: str


@dataclass
class Plan:
    candidates: list[Candidate]
    not_paying: list[dict] = field(default_factory=list)  # drafters not expected to pay, with their numbers

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def to_json(self) -> dict:
        return {"candidates": [asdict(c) for c in self.candidates], "not_paying": self.not_paying}


@dataclass
class RecordedAdapter:
    """An exit adapter and what its training recorded: its directory, E, parameters, draft vocabulary rows and
    greedy agreement on the model's own generations (None when not recorded)."""

    path: str
    exit_layer: int
    parameters: int
    head_rows: int | None
    agreement: float | None


def recorded_adapter(path: str) -> RecordedAdapter:
    """An exit adapter's record without loading it: ``adapter.json`` (E, parameters, draft vocabulary) and the
    agreement its training run measured (``adapters.json`` beside it, when there is one)."""
    directory = resolve_adapter(path)
    meta = read_meta(directory)
    index = directory.parent / INDEX_FILE
    agreement = None
    if index.is_file():
        found = (json.loads(index.read_text(encoding="utf-8")).get("agreement") or {}).get("adapter") or {}
        agreement = found.get(str(meta["exit_layer"]))
    vocab = meta.get("draft_vocab") or {}
    return RecordedAdapter(
        str(directory), meta["exit_layer"], meta["parameters"], vocab.get("size"), agreement
    )


def _drafter(
    costs: CostModel, name: str, exit_layer: int, alpha: float | None, token: float, options: dict, plan: Plan
) -> None:
    """Add the chain through this drafter to ``plan`` when it is expected to pay, else note why not."""
    if alpha is None:
        plan.not_paying.append({"drafter": name, "exit": exit_layer, "reason": "no acceptance recorded"})
        return
    choice = choose_exit({exit_layer: alpha}, costs, draft_costs={exit_layer: token}, min_speedup=MIN_SPEEDUP)
    if choice["exit"] is None:
        found = choice["best_found"]
        plan.not_paying.append(
            {
                "drafter": name,
                "exit": exit_layer,
                "acceptance": alpha,
                "expected_speedup": found["expected_speedup"],
            }
        )
        return
    options = options | {"chain": True, "policy": "adaptive", "draft_tokens": MAX_DRAFT}
    reason = f"acceptance {alpha:.2f} at E={exit_layer}: {choice['expected_speedup']:.2f}x expected (K={choice['draft']})"
    plan.candidates.append(
        Candidate(f"prompt_lookup+{name}", "self_speculative", options, choice["expected_speedup"], reason)
    )


def plan_decoding(
    m: EarlyExitModel,
    costs: CostModel,
    *,
    exit_agreement: dict[int, float] | None = None,
    adapter: RecordedAdapter | None = None,
) -> Plan:
    """The lossless decoders expected to pay on ``m`` (see the module docstring), best first.

    ``exit_agreement``: per exit, the acceptance a LayerSkip checkpoint records (``exit_report.json``);
    ``adapter``: an exit adapter and its recorded agreement.
    """
    plan = Plan([])
    if adapter is not None:
        token = 0.0
        if adapter.agreement is not None:  # else nothing to weigh the cost against
            loaded, _, vocab = load_adapter(adapter.path, m)
            token = exit_draft_cost(costs, m, adapter.exit_layer, adapter=loaded, vocab=vocab)
        _drafter(
            costs, "adapter", adapter.exit_layer, adapter.agreement, token, {"adapter": adapter.path}, plan
        )
    if exit_agreement:
        choice = choose_exit(exit_agreement, costs, draft_costs=None)
        exit_layer = choice["exit"] or (choice.get("best_found") or {}).get("exit")
        if exit_layer is not None:
            alpha = exit_agreement.get(exit_layer, exit_agreement.get(str(exit_layer)))
            token = exit_draft_cost(costs, m, exit_layer)
            _drafter(costs, "exit", exit_layer, alpha, token, {"exit_layer": exit_layer}, plan)
    plan.candidates.sort(key=lambda c: -(c.expected_speedup or 0.0))
    plan.candidates.append(
        Candidate(
            "prompt_lookup",
            "prompt_lookup",
            {"policy": "adaptive", "draft_tokens": LOOKUP_DRAFT},
            None,
            "free drafts from the row's own text; a row with no match pays nothing",
        )
    )
    return plan
