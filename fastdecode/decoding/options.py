"""Per-decoder option groups, nested in ``DecodeConfig``: ``decoder.jacobi.*``, ``decoder.skip.*``,
``decoder.lookup.*``.

Why nested: the fields every decoder reads (length, sampling, exit layer, draft policy) stay flat in
``DecodeConfig``; options that only one decoder reads sit in a group named after it, so ``common.py`` knows
nothing of any one decoder and a Hydra override says which decoder it tunes (``jacobi.block=8``).
Each group checks what it can without a model; the rest is checked by its decoder against the model.
``SkipOptions`` (``decoder.skip``) is the SkipDecode concept's own (``fastdecode/skipdecode.py``): the recipe
reads the same dataclass, so an option means the same when training and when decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.jacobi import check_block_size, check_init
from fastdecode.skipdecode import SkipOptions

__all__ = ["JacobiOptions", "LookupOptions", "SkipOptions"]

MATCHES = ("recent", "earliest")  # decoder.lookup.match (fastdecode/decoding/ngram.py's NgramIndex)
EOS_CUTS = ("before", "after")  # decoder.lookup.eos


@dataclass
class JacobiOptions:
    """``decoder.jacobi``: the ``jacobi`` decoder (``fastdecode/decoding/jacobi.py``). ``block``: the n >= 2
    tokens refined in parallel; ``init``: the initial guess, ``repeat`` | ``prompt`` | ``vocab``."""

    block: int = 16
    init: str = "repeat"

    def __post_init__(self) -> None:
        check_block_size(self.block, "decoder.jacobi.block")
        check_init(self.init, "decoder.jacobi.init")


@dataclass
class LookupOptions:
    """``decoder.lookup``: n-gram drafting from a row's own text (``prompt_lookup``, ``lookahead``, and the
    chains of ``self_speculative``/``assisted`` with ``decoder.chain=true``; ``fastdecode/decoding/ngram.py``).
    ``max_ngram_size``: the longest suffix looked up (transformers' ``max_matching_ngram_size``);
    ``min_ngram_size``: the shortest. The most tokens proposed is ``decoder.draft_tokens``.
    ``match``: which earlier occurrence of the row's last n tokens is continued, ``recent`` (the most recent)
    or ``earliest`` (the first, as transformers and vLLM do); ``eos``: ``before`` (a draft never holds an EOS,
    as in transformers) or ``after`` (it may end with one). Chosen by replaying SmolLM2's answers
    (``fastdecode-lookup-replay``, docs/BENCHMARKS.md).
    ``fallback_trial``: in a chain, the row-rounds the exit, adapter or draft model drafts before it must have
    paid for itself on this call's text to go on drafting (``ngram.ChainProposer``); 0: it is never retired.
    ``tree`` (``prompt_lookup`` only): draft the merged continuations of up to ``occurrences`` earlier
    occurrences as one token tree (``fastdecode/decoding/lookup_tree.py``); ``shorter``: merge those of the
    shorter matches too. False (the default): one continuation, a chain."""

    max_ngram_size: int = 4
    min_ngram_size: int = 1
    fallback_trial: int = 16
    match: str = "recent"
    eos: str = "before"
    tree: bool = False
    occurrences: int = 4
    shorter: bool = False

    def __post_init__(self) -> None:
        for key, value, choices in (("match", self.match, MATCHES), ("eos", self.eos, EOS_CUTS)):
            if value not in choices:
                raise unknown_name_error(f"lookup {key}", value, list(choices), f"(decoder.lookup.{key})")
        if not 1 <= self.min_ngram_size <= self.max_ngram_size:
            raise ConfigError(
                f"decoder.lookup: min_ngram_size={self.min_ngram_size}, max_ngram_size={self.max_ngram_size}: "
                "need 1 <= min_ngram_size <= max_ngram_size."
            )
        if self.occurrences < 1:
            raise ConfigError(
                f"decoder.lookup.occurrences={self.occurrences}: need >= 1 (the earlier occurrences a tree "
                "lookup merges per n-gram)."
            )
        if self.fallback_trial < 0:
            raise ConfigError(
                f"decoder.lookup.fallback_trial={self.fallback_trial}: need >= 0 (0: the fallback is never "
                "retired)."
            )
