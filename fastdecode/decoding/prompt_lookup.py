"""Prompt lookup decoding (Saxena, 2023; transformers' ``prompt_lookup_num_tokens``): drafts are the
continuation of the most recent earlier occurrence of a row's last n tokens in its prompt and output, verified
by the whole model; lossless, free to draft, no training.

The speculative loop (``speculative.py``) over a ``PromptLookupProposer`` (``ngram.py``): ``decoder.lookup``
sets the n-gram sizes, ``decoder.draft_tokens`` the most tokens proposed, and ``policy=adaptive`` cuts each
draft where the cost model (``fastdecode/cost.py``) expects the most tokens per cost. Unlike transformers',
batches of any size decode, each row with its own draft length.
"""

from __future__ import annotations

from fastdecode.decoding.common import DecodeConfig
from fastdecode.decoding.drafters import ProposerKind, Setup
from fastdecode.decoding.ngram import PromptLookupProposer, refuse_exit_layer
from fastdecode.model import EarlyExitModel

HINT = (
    ", or use 'self_speculative' with decoder.chain=true to draft through an exit where the lookup finds "
    "nothing"
)


def check_lookup(m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft=None) -> None:
    refuse_exit_layer("prompt_lookup", cfg, HINT)


def build(s: Setup) -> PromptLookupProposer:
    return PromptLookupProposer(s.prompts, s.cfg, s.costs, s.m.vocab_size)


KIND = ProposerKind("prompt_lookup", build, check=check_lookup)
generate = KIND.generate
