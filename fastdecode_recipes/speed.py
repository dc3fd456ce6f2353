"""The closing speed line of the self-speculating recipes (``layerskip``, ``exit_adapter``): self-speculation
against autoregressive decoding on a few held-out prompts, greedy, batch 1, timed after a warm-up."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from fastdecode.data.chat import user_prompt_ids
from fastdecode.decoding import DecodeConfig, get_decoder
from fastdecode.model import EarlyExitModel

log = logging.getLogger(__name__)


def speed_line(
    m: EarlyExitModel, tokenizer: Any, prompts: list[str], report: Any, drafting: dict[str, Any], label: str
) -> dict:
    """Time self-speculation (adaptive policy, ``drafting``: the ``DecodeConfig`` fields that say how it
    drafts, e.g. ``exit_layer`` or ``adapter``) against autoregressive decoding on the first
    ``report.speed_prompts`` prompts; print one line ("self-speculation <label>: ..."), return the numbers
    (empty without a prompt). ``report``: a recipe's report config (``speed_prompts``, ``speed_new_tokens``,
    ``max_draft``)."""
    ids = [user_prompt_ids(tokenizer, p) for p in prompts[: report.speed_prompts]]
    if not ids:
        return {}
    base = DecodeConfig(max_new_tokens=report.speed_new_tokens, eos_token_id=tokenizer.eos_token_id)
    spec = dataclasses.replace(base, policy="adaptive", draft_tokens=report.max_draft, **drafting)
    result: dict[str, Any] = {}
    for name, cfg in (("autoregressive", base), ("self_speculative", spec)):
        get_decoder(name)(m, ids[:1], dataclasses.replace(cfg, max_new_tokens=2))  # warm-up
        start = time.perf_counter()
        outs = [get_decoder(name)(m, [p], cfg) for p in ids]
        seconds = time.perf_counter() - start
        tokens = sum(o.num_tokens for o in outs)
        result[name] = {"tokens_per_s": tokens / seconds, "tokens": tokens}
    result["acceptance"] = sum(sum(o.accepted) for o in outs) / max(1, sum(sum(o.drafted) for o in outs))
    result["speedup"] = result["self_speculative"]["tokens_per_s"] / result["autoregressive"]["tokens_per_s"]
    line = (
        f"self-speculation {label}: {result['self_speculative']['tokens_per_s']:.1f} tok/s vs "
        f"autoregressive {result['autoregressive']['tokens_per_s']:.1f} tok/s ({result['speedup']:.2f}x, "
        f"acceptance {result['acceptance']:.2f}; {len(ids)} held-out prompts, greedy, batch 1)"
    )
    log.info(line)
    print(line)
    return result
