"""SkipDecode decoding: one dense, shrinking set of layers per step for the whole batch, KV-cached.

Step ``k`` runs the warm-up layers ``[0, w)`` and the top layers ``[L-(b(k)-w), L)`` of the policy in
``fastdecode/skipdecode.py``, whose options are ``decoder.skip.*`` (``DecodeConfig.skip``); the prompt is
prefilled at full depth. The loop is ``autoregressive.decode_steps`` with that schedule. Why the cache stays
complete, and where trained options come from: docs/design/decoding.md.
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
