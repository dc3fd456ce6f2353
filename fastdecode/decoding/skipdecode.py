"""SkipDecode decoding: one dense, shrinking set of layers per step for the whole batch, KV-cached.

Step ``k`` (the k-th new token of every row) runs the warm-up layers ``[0, w)`` and the top layers
``[L-(b(k)-w), L)`` of the policy in ``fastdecode/skipdecode.py``; the prompt is prefilled at full depth.
The loop is autoregressive decoding's (``autoregressive.decode_steps``) with that per-step schedule.

Why the cache stays complete without recomputation: the adapter puts the queries of a ``run_layers`` call at
slot ``cache.lengths[start]``. Layer 0 (when ``w > 0``) and every top layer that runs at step ``k`` also ran
at every earlier step (the budget never increases), so their lengths all equal the current slot and their
caches hold every earlier token. A layer skipped at step ``k`` is never run again, so its shorter cache is
never read. The slot of the step is taken from the last layer, which every step runs.

The options (``DecodeConfig.skip``, ``decoder.skip.*``) of a ``recipe=skipdecode`` run are in its
``final/skipdecode.json``; ``read_skip_options`` reads them, in the nested format and in the flat one of
files written before (``skip_max_budget``, ...), so checkpoints trained then keep their policy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fastdecode.config import ConfigError, to_dataclass
from fastdecode.decoding.autoregressive import decode_steps
from fastdecode.decoding.common import DecodeConfig, DecodeOutput, check, configure_engine, refuse_draft_model
from fastdecode.decoding.options import SkipOptions
from fastdecode.model import EarlyExitModel
from fastdecode.skipdecode import SkipDecodePolicy


def policy_from_config(cfg: DecodeConfig, num_layers: int, prompt_len: int) -> SkipDecodePolicy:
    """The policy of ``cfg.skip`` for a model of ``num_layers`` and a batch whose longest prompt has
    ``prompt_len`` tokens; every value is checked here, before any model work."""
    skip = cfg.skip
    max_budget = num_layers if skip.max_budget is None else skip.max_budget
    policy = SkipDecodePolicy(
        num_layers=num_layers,
        max_budget=max_budget,
        min_budget=max_budget if skip.min_budget is None else skip.min_budget,
        warmup_layers=skip.warmup_layers,
        max_length=prompt_len + cfg.max_new_tokens if skip.max_length is None else skip.max_length,
        keys="decoder.skip.",
    )
    policy.check_prompt(prompt_len)
    return policy


def read_skip_options(path: str | os.PathLike) -> SkipOptions:
    """``DecodeConfig.skip`` from a ``skipdecode.json`` written by ``recipe=skipdecode``: ``{"skip": {...}}``,
    or the flat ``skip_*`` keys of files written before the options were nested (read the same way)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot read SkipDecode options ({err}).") from err
    flat = {key.removeprefix("skip_"): value for key, value in data.items() if key.startswith("skip_")}
    if "skip" in data and flat:
        raise ConfigError(f"{path}: has both 'skip' and flat skip_* keys ({', '.join(flat)}); keep one.")
    if "skip" not in data and not flat:
        raise ConfigError(f"{path}: no SkipDecode options (a 'skip' mapping) in it.")
    return to_dataclass(SkipOptions, data.get("skip", flat), f"{path}: skip")


@torch.inference_mode()
def generate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """Decode ``prompts`` (batch of token-id lists) one token per step under the SkipDecode policy.

    ``layers_run`` counts decoder-layer x token applications of active rows after the prefill (the budget
    per token); ``layer_calls`` the budget per step. Finished rows run a filler as in autoregressive.
    """
    check(cfg, m, prompts)
    refuse_draft_model("skipdecode", draft)
    if cfg.exit_layer is not None:
        raise ConfigError(
            f"decoder.exit_layer={cfg.exit_layer}: skipdecode always ends at the last layer (its budgets "
            "come from decoder.skip.*); set exit_layer=null."
        )
    configure_engine(m, cfg)  # the execution engine this call decodes on (the checks above change nothing)
    width = max(len(p) for p in prompts)
    policy = policy_from_config(cfg, m.num_layers, width)
    budgets = policy.response_budgets(cfg.max_new_tokens, width).tolist()  # one per step, whole batch
    schedule = [policy.layer_ranges(budget) for budget in budgets]
    return decode_steps(m, prompts, cfg, schedule=schedule, prefill_depth=m.num_layers)
