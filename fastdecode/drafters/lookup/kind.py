"""Prompt lookup decoding (Saxena, 2023; transformers' ``prompt_lookup_num_tokens``): the ``prompt_lookup``
decoder.

Drafts continue an earlier occurrence of a row's last n tokens in its prompt and output, verified by the
whole model: lossless, free to draft, no training. This module owns the decoder's checks and builds its
proposer: ``ngram.PromptLookupProposer``, or ``tree.TreeLookupProposer`` with ``decoder.lookup.tree=true``.
The options are ``decoder.lookup`` (``options.LookupOptions``). Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

from fastdecode.decoding.common import refuse_exit_layer
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.kinds import ProposerKind, Setup
from fastdecode.drafters.lookup.ngram import PromptLookupProposer
from fastdecode.drafters.lookup.options import LookupOptions
from fastdecode.drafters.lookup.tree import TreeLookupProposer
from fastdecode.runtime.model import EarlyExitModel

HINT = (
    ", or use 'self_speculative' with decoder.chain=true to draft through an exit where the lookup finds "
    "nothing"
)


def check_lookup(m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft=None) -> None:
    refuse_exit_layer("prompt_lookup", cfg, HINT)


def build(s: Setup) -> PromptLookupProposer:
    """The chain lookup, or with ``decoder.lookup.tree`` the tree lookup (``tree.py``)."""
    kind = TreeLookupProposer if LookupOptions.of(s.cfg).tree else PromptLookupProposer
    return kind(s.prompts, s.cfg, s.costs, s.m.vocab_size)


KIND = ProposerKind("prompt_lookup", build, check=check_lookup)
generate = KIND.generate
