"""The closing speed line of the self-speculating recipes (``layerskip``, ``exit_adapter``): the lossless
decoders the cost model expects to pay on the trained checkpoint (``fastdecode.choose.plan_decoding``: prompt
lookup, chained before the exit or the adapter when that drafter is expected to pay), each against
autoregressive decoding on a few held-out prompts, greedy, batch 1, timed after a warm-up, side by side; the
best is named, and a drafter not expected to pay is named as such."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from fastdecode.choose import Plan
from fastdecode.data.chat import user_prompt_ids
from fastdecode.decoding import DecodeConfig, get_decoder
from fastdecode.model import EarlyExitModel

log = logging.getLogger(__name__)


def _time(m: EarlyExitModel, name: str, cfg: DecodeConfig, ids: list[list[int]]) -> dict:
    decoder = get_decoder(name)
    decoder(m, ids[:1], dataclasses.replace(cfg, max_new_tokens=2))  # warm-up (and the cost model, once)
    start = time.perf_counter()
    outs = [decoder(m, [p], cfg) for p in ids]
    seconds = time.perf_counter() - start
    tokens = sum(o.num_tokens for o in outs)
    drafted = sum(sum(o.drafted) for o in outs)
    accepted = sum(sum(o.accepted) for o in outs)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "acceptance": accepted / max(1, drafted)}


def _not_paying(plan: Plan) -> str:
    parts = []
    for item in plan.not_paying:
        expected = item.get("expected_speedup")
        detail = item.get("reason") or f"acceptance {item['acceptance']:.2f}, expected {expected:.2f}x"
        parts.append(f"{item['drafter']} at E={item['exit']} ({detail})")
    return f"; not expected to pay: {', '.join(parts)}" if parts else ""


def speed_line(m: EarlyExitModel, tokenizer: Any, prompts: list[str], report: Any, plan: Plan) -> dict:
    """Time every decoder of ``plan`` and autoregressive decoding on the first ``report.speed_prompts``
    prompts (``report``: a recipe's report config with ``speed_prompts``, ``speed_new_tokens``); print one
    line, return the numbers (empty without a prompt)."""
    ids = [user_prompt_ids(tokenizer, p) for p in prompts[: report.speed_prompts]]
    if not ids:
        return {}
    base = DecodeConfig(max_new_tokens=report.speed_new_tokens, eos_token_id=tokenizer.eos_token_id)
    result: dict[str, Any] = {"autoregressive": _time(m, "autoregressive", base, ids), "decoders": {}}
    ar = result["autoregressive"]["tokens_per_s"]
    for candidate in plan.candidates:
        cfg = dataclasses.replace(base, **candidate.options)
        timed = _time(m, candidate.method, cfg, ids)
        timed |= {"speedup": timed["tokens_per_s"] / ar, "expected_speedup": candidate.expected_speedup}
        result["decoders"][candidate.name] = timed
    best = max(result["decoders"], key=lambda name: result["decoders"][name]["speedup"])
    result["best"], result["speedup"] = best, result["decoders"][best]["speedup"]
    shown = ", ".join(
        f"{name} {r['tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x, acceptance {r['acceptance']:.2f})"
        for name, r in result["decoders"].items()
    )
    line = (
        f"speed on {len(ids)} held-out prompts (greedy, batch 1): autoregressive {ar:.1f} tok/s; {shown}; "
        f"best: {best} ({result['speedup']:.2f}x){_not_paying(plan)}"
    )
    log.info(line)
    print(line)
    return result | {"plan": plan.to_json()}
