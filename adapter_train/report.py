"""The exit adapters' report (``recipe=exit_adapter``): raw exit vs adapter agreement on the frozen model's own
greedy generations, the head-aware exit choice (``adapters.json``), perplexity, and the closing speed line."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from adapter_train.config import ExitAdapterConfig
from fastdecode.drafters.exits.adapter import INDEX_FILE, ExitAdapter
from fastdecode.files.io import atomic_write_json
from fastdecode.plan.choose import adapter_draft_costs, choose_exit, plan_decoding
from fastdecode.plan.cost import decoding_costs, exit_draft_cost
from fastdecode.reports.exits import (
    adapter_agreement_text,
    adapter_generation_report,
    choice_sentence,
    greedy_generations,
    model_perplexity,
)
from fastdecode.runtime.identity import weights_fingerprint
from fastdecode.runtime.machine import machine_label
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.runtime.progress import phase
from recipes.speed import speed_line

log = logging.getLogger(__name__)


def cached_generations(model, tokenizer, prompts: list[str], max_new_tokens: int, directory: Path) -> list:
    """The frozen model's greedy generations of ``prompts``, computed once per model and stored in
    ``directory`` (the model never changes in this recipe, so every run may reuse them)."""
    key = json.dumps([weights_fingerprint(model), prompts, max_new_tokens])
    path = directory / f"generations-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.is_file():
        return [(ids, n) for ids, n in json.loads(path.read_text())]
    what = f"{len(prompts)} greedy generations of up to {max_new_tokens} tokens (cached in {directory})"
    with phase("exit adapters' report", what, total=len(prompts), unit="prompt") as progress:
        generations = greedy_generations(model, tokenizer, prompts, max_new_tokens, progress)
    atomic_write_json(path, generations)
    return generations


def _choices(m: EarlyExitModel, costs, agreement: dict, draft_costs: dict, r, vocab) -> tuple[dict, dict]:
    """The exit with the best expected speedup through its adapter, and through the raw exit, from the
    recorded agreement and replayed rounds (``fastdecode.plan.choose.choose_exit``)."""
    raw_costs = {e: exit_draft_cost(costs, m, e, vocab=vocab) for e in agreement["raw"]}
    found = {
        head: choose_exit(
            agreement[head],
            costs,
            draft_costs=head_costs,
            rounds=agreement["tokens_per_round"][head],
            max_draft=r.max_draft,
            min_speedup=r.min_speedup,
        )
        for head, head_costs in (("adapter", draft_costs), ("raw", raw_costs))
    }
    choice, raw_choice = found["adapter"], found["raw"]
    return choice, raw_choice


def report(
    m: EarlyExitModel,
    tokenizer: Any,
    report_set: list[dict],
    rcfg: ExitAdapterConfig,
    *,
    adapters: dict[int, ExitAdapter],
    vocab: torch.Tensor | None,
    feature_dir: Path,
    stage: Path,
) -> tuple[dict, dict]:
    """``(adapters.json, summary fields)``: agreement raw vs adapter on the model's own greedy generations
    (cached in ``feature_dir``), the chosen exit, perplexity, the speed line through the best adapter (read
    from the export's staging directory ``stage``). ``vocab``: the draft vocabulary ``[S]`` or None."""
    index = {"adapters": {str(e): f"E{e}" for e in adapters}, "chosen": None}
    if not rcfg.report.enabled:
        return index, {"chosen": None}
    r = rcfg.report
    prompts = [ex["prompt"] for ex in report_set if ex.get("prompt")][: r.prompts]
    generations = cached_generations(m.hf, tokenizer, prompts, r.max_new_tokens, feature_dir)
    with torch.no_grad():
        agreement = adapter_generation_report(m, adapters, generations, vocab)
        ppl = model_perplexity(m, report_set, r.held_out_examples)
    costs = decoding_costs(m)
    draft_costs = adapter_draft_costs(costs, m, adapters, vocab)
    choice, raw_choice = _choices(m, costs, agreement, draft_costs, r, vocab)
    index |= {
        "chosen": choice["exit"],
        "choice": choice,
        "agreement": {head: agreement[head] for head in ("raw", "adapter")},
        "tokens_per_round": agreement["tokens_per_round"],
        "draft_costs": draft_costs,
    }
    measured_on = machine_label(m.device)
    log.info(
        "exit adapters: agreement with the final layer, raw exit -> adapter: %s",
        adapter_agreement_text(agreement),
    )
    log.info("exit adapters: %s", choice_sentence(choice, measured_on))
    best = choice["exit"] or (choice.get("best_found") or {}).get("exit")
    speed = {}
    if best is not None and r.speed_prompts > 0:
        atomic_write_json(stage / INDEX_FILE, index)  # the record the plan reads beside the adapter
        plan = plan_decoding(m, costs, adapter=str(stage / f"E{best}"))
        speed = speed_line(m, tokenizer, prompts, r, plan)
    return index, {
        "agreement": agreement,
        "chosen": choice,
        "raw_exit_choice": raw_choice,
        "draft_costs": draft_costs,
        "costs": costs.to_json() | {"measured_on": measured_on},
        "perplexity": ppl,
        "speed": speed,
    }
