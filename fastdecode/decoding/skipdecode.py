"""SkipDecode decoding: one dense, shrinking set of layers per step for the whole batch, KV-cached.

Step ``k`` (the k-th new token of every row) runs the warm-up layers ``[0, w)`` and the top layers
``[L-(b(k)-w), L)`` of the policy in ``fastdecode/skipdecode.py``; the prompt is prefilled at full depth.
The loop is autoregressive decoding's (``autoregressive.decode_steps``) with that per-step schedule.

Why the cache stays complete without recomputation: the adapter puts the queries of a ``run_layers`` call at
slot ``cache.lengths[start]``. Layer 0 (when ``w > 0``) and every top layer that runs at step ``k`` also ran
at every earlier step (the budget never increases), so their lengths all equal the current slot and their
caches hold every earlier token. A layer skipped at step ``k`` is never run again, so its shorter cache is
never read. The slot of the step is taken from the last layer, which every step runs.

The options (``DecodeConfig.skip``, ``decoder.skip.*``) are ``fastdecode.skipdecode.SkipOptions``, the ones
the recipe trains with; a ``recipe=skipdecode`` checkpoint records its policy in ``skipdecode.json``, which
``fastdecode.from_pretrained`` and ``eval/skipdecode_quality.py`` decode with (``trained_options``).
"""

from __future__ import annotations

import torch

from fastdecode.config import ConfigError
from fastdecode.decoding.autoregressive import decode_steps
from fastdecode.decoding.common import check, configure_engine, refuse_draft_model
from fastdecode.decoding.config import DecodeConfig, DecodeOutput
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.skipdecode import SkipDecodePolicy


def policy_from_config(cfg: DecodeConfig, num_layers: int, prompt_len: int) -> SkipDecodePolicy:
    """The policy of ``cfg.skip`` for a model of ``num_layers`` and a batch whose longest prompt has
    ``prompt_len`` tokens (``max_length`` left None: ``prompt_len + max_new_tokens``); every value is checked
    here, before any model work."""
    policy = cfg.skip.policy(num_layers, prompt_len + cfg.max_new_tokens)
    policy.check_prompt(prompt_len)
    return policy


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
