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

from fastdecode.decoding.common import DecodeConfig, DecodeOutput
from fastdecode.decoding.ngram import PromptLookupProposer, generate_from_text
from fastdecode.model import EarlyExitModel


@torch.inference_mode()
def generate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """Prompt lookup decoding of ``prompts``; output equals ``autoregressive`` (greedy), or its distribution."""
    hint = (
        ", or use 'self_speculative' with decoder.chain=true to draft through an exit where the lookup finds "
        "nothing"
    )
    return generate_from_text(
        m, prompts, cfg, draft, name="prompt_lookup", proposer=PromptLookupProposer, hint=hint
    )
