"""The closing speed table of the self-speculating recipes (``layerskip``, ``exit_adapter``): every candidate of
the plan (``fastdecode.plan.choose.plan_decoding``: prompt lookup, chained before the exit or the adapter when that
drafter is expected to pay) against autoregressive decoding on a few held-out prompts, greedy, batch 1, timed
after a warm-up, side by side; the drafters not expected to pay are listed with their numbers. Printed as a
small table and one sentence that names what ``auto`` runs and the machine it was measured on."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastdecode.data.chat import user_prompt_ids
from fastdecode.decoding.config import DecodeConfig
from fastdecode.plan.choose import Plan
from fastdecode.registry import get_decoder
from fastdecode.runtime.machine import machine_label
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.runtime.progress import phase
from fastdecode.tokens import eos_ids


def _time(m: EarlyExitModel, name: str, cfg: DecodeConfig, ids: list[list[int]], progress) -> dict:
    decoder = get_decoder(name)
    decoder(m, ids[:1], dataclasses.replace(cfg, max_new_tokens=2))  # warm-up (and the cost model, once)
    outs, seconds = [], 0.0
    for prompt in ids:
        start = time.perf_counter()
        outs.append(decoder(m, [prompt], cfg))
        seconds += time.perf_counter() - start
        progress.update()
    tokens = sum(o.num_tokens for o in outs)
    drafted = sum(sum(o.drafted) for o in outs)
    accepted = sum(sum(o.accepted) for o in outs)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "acceptance": accepted / max(1, drafted)}


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def speed_table(result: dict, plan: Plan) -> list[str]:
    """The table's lines: autoregressive decoding, every candidate of the plan (what ``auto`` runs first),
    then each drafter not expected to pay (not run)."""
    lines = [
        "| decoder | drafter | exit | recorded acceptance | expected | measured | tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| autoregressive | - | - | - | 1.00x | 1.00x | {result['autoregressive']['tokens_per_s']:.1f} |",
    ]
    for i, c in enumerate(plan.candidates):
        timed = result["decoders"][c.name]
        name = f"{c.name} (auto)" if i == 0 else c.name
        lines.append(
            f"| {name} | {c.drafter} | {_cell(c.exit_layer, '{}')} | {_cell(c.acceptance, '{:.2f}')} | "
            f"{_cell(c.expected_speedup, '{:.2f}x')} | {timed['speedup']:.2f}x | {timed['tokens_per_s']:.1f} |"
        )
    for item in plan.not_paying:
        expected = _cell(item.get("expected_speedup"), "{:.2f}x")
        lines.append(
            f"| not run: not expected to pay | {item['drafter']} | {_cell(item.get('exit'), '{}')} | "
            f"{_cell(item.get('acceptance'), '{:.2f}')} | {expected} | - | - |"
        )
    return lines


def speed_sentence(result: dict, plan: Plan, prompts: int, machine: str) -> str:
    best = plan.best
    timed = result["decoders"][best.name]
    sentence = (
        f"auto runs {best.name}: {timed['speedup']:.2f}x our autoregressive decoder "
        f"({result['autoregressive']['tokens_per_s']:.1f} tok/s) on {prompts} held-out prompts "
        f"(greedy, batch 1, {machine})"
    )
    trained = [item for item in plan.not_paying if item.get("expected_speedup") is not None]
    if trained:
        top = max(trained, key=lambda item: item["expected_speedup"])
        sentence += (
            f"; no trained drafter is expected to pay on its own yet (best: {top['drafter']} at "
            f"E={top['exit']}, {top['expected_speedup']:.2f}x expected)"
        )
    return sentence + "."


def speed_line(m: EarlyExitModel, tokenizer: Any, prompts: list[str], report: Any, plan: Plan) -> dict:
    """Time every candidate of ``plan`` and autoregressive decoding on the first ``report.speed_prompts``
    prompts (``report``: a recipe's report config with ``speed_prompts``, ``speed_new_tokens``); return the
    numbers with ``text``, the table and its sentence, which ``finetune`` prints as the run's last lines
    (``closing_text``); empty without a prompt."""
    ids = [user_prompt_ids(tokenizer, p) for p in prompts[: report.speed_prompts]]
    if not ids:
        return {}
    eos = sorted(eos_ids(m.hf, tokenizer)) or None
    base = DecodeConfig(max_new_tokens=report.speed_new_tokens, eos_token_id=eos)
    calls = len(ids) * (1 + len(plan.candidates))
    what = f"autoregressive and {len(plan.candidates)} planned decoder(s) on {len(ids)} held-out prompts"
    with phase("speed table", what, total=calls, unit="call") as progress:
        result: dict[str, Any] = {"autoregressive": _time(m, "autoregressive", base, ids, progress)}
        result["decoders"] = {}
        ar = result["autoregressive"]["tokens_per_s"]
        for candidate in plan.candidates:
            cfg = dataclasses.replace(base, **candidate.options)
            timed = _time(m, candidate.method, cfg, ids, progress)
            timed |= {"speedup": timed["tokens_per_s"] / ar, "expected_speedup": candidate.expected_speedup}
            result["decoders"][candidate.name] = timed
    best = max(result["decoders"], key=lambda name: result["decoders"][name]["speedup"])
    machine = machine_label(m.device)
    result |= {"best": best, "speedup": result["decoders"][best]["speedup"], "machine": machine}
    text = "\n".join([*speed_table(result, plan), speed_sentence(result, plan, len(ids), machine)])
    return result | {"plan": plan.to_json(), "text": text}


def closing_text(summary: dict) -> str | None:
    """The speed table a recipe's summary carries (``speed_line``'s ``text``), or None."""
    return (summary.get("speed") or {}).get("text")
