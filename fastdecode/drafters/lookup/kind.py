"""Prompt lookup decoding (Saxena, 2023; transformers' ``prompt_lookup_num_tokens``): drafts are the
continuation of an earlier occurrence of a row's last n tokens in its prompt and output, verified by the whole
model; lossless, free to draft, no training.

The speculative loop (``speculative.py``) over a ``PromptLookupProposer`` (``ngram.py``): ``decoder.lookup``
sets the n-gram sizes (n from 4 down to 1), which occurrence is continued (``match``: the most recent, or the
earliest) and where an EOS cuts a draft (``eos``: before it, or after it); ``decoder.draft_tokens`` the most
tokens proposed, and ``policy=adaptive`` cuts each draft where the cost model (``fastdecode/plan/cost.py``) expects
the most tokens per cost. Unlike transformers', batches of any size decode, each row with its own draft length.

Not transformers' semantics, nor vLLM's: both continue the *earliest* occurrence (transformers: n <= 2 by
default, the draft cut before an EOS; vLLM: only n in [``prompt_lookup_min``, ``prompt_lookup_max``], 5 and 5
by default, no EOS cut). Here the *most recent* one is the default, because replaying SmolLM2's greedy
answers to ShareGPT training prompts (``fastdecode-lookup-replay``) gave it 0.3-1.9% more expected speedup
than the earliest under every cost model tried (2.2-2.6% more than transformers' defaults); n <= 4 and n <= 3
tie within 0.1%, n <= 2 is 0.1-1.7% behind, n = 1 alone 2-19%; cutting before or after an EOS ties (an
accepted EOS ends the row, which the verifier's own token would have done too, so drafting it can only cost).
docs/BENCHMARKS.md has the table.
``decoder.lookup.match=earliest`` gives transformers' and vLLM's choice.
``decoder.lookup.tree=true`` drafts the continuations of several occurrences merged into one token tree
(``lookup_tree.py``; ``configs/decoder/prompt_lookup_tree.yaml``).
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
    """The chain lookup, or with ``decoder.lookup.tree`` the tree lookup (``lookup_tree.py``)."""
    kind = TreeLookupProposer if LookupOptions.of(s.cfg).tree else PromptLookupProposer
    return kind(s.prompts, s.cfg, s.costs, s.m.vocab_size)


KIND = ProposerKind("prompt_lookup", build, check=check_lookup)
generate = KIND.generate
