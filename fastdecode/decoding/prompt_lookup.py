"""Prompt lookup decoding (Saxena, 2023; transformers' ``prompt_lookup_num_tokens``): drafts are the
continuation of the most recent earlier occurrence of a row's last n tokens in its prompt and output, verified
by the whole model; lossless, free to draft, no training.

The speculative loop (``speculative.py``) over a ``PromptLookupProposer`` (``ngram.py``): ``decoder.lookup``
sets the n-gram sizes, ``decoder.draft_tokens`` the most tokens proposed, and ``policy=adaptive`` cuts each
draft where the cost model (``fastdecode/cost.py``) expects the most tokens per cost. Unlike transformers',
batches of any size decode, each row with its own draft length.
"""

from __future__ import annotations

import torch

from fastdecode.config import ConfigError
from fastdecode.cost import cost_model
from fastdecode.decoding.common import (
    DecodeConfig,
    DecodeOutput,
    check,
    configure_engine,
    new_generator,
    refuse_draft_model,
)
from fastdecode.decoding.ngram import PromptLookupProposer
from fastdecode.decoding.speculative import speculate
from fastdecode.model import EarlyExitModel


@torch.inference_mode()
def generate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """Prompt lookup decoding of ``prompts``; output equals ``autoregressive`` (greedy), or its distribution."""
    check(cfg, m, prompts)
    refuse_draft_model("prompt_lookup", draft)
    if cfg.exit_layer is not None:
        raise ConfigError(
            f"decoder 'prompt_lookup' verifies with the whole model: set decoder.exit_layer=null (got "
            f"{cfg.exit_layer}), or use 'self_speculative' with decoder.chain=true to draft through an exit "
            "where the lookup finds nothing."
        )
    configure_engine(m, cfg)  # the execution engine this call decodes on (the checks above change nothing)
    proposer = PromptLookupProposer(prompts, cfg, cost_model(m, cfg.costs), m.vocab_size)
    generator = new_generator(cfg, m.device)
    return speculate(m, prompts, cfg, proposer, generator=generator)
