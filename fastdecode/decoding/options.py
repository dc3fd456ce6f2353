"""Per-decoder option groups, nested in ``DecodeConfig``: ``decoder.jacobi.*``, ``decoder.skip.*``,
``decoder.lookup.*``, ``decoder.suffix.*``, ``decoder.eagle3.*``.

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

__all__ = ["Eagle3Options", "JacobiOptions", "LookupOptions", "SkipOptions", "SuffixOptions"]

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


@dataclass
class SuffixOptions:
    """``decoder.suffix``: suffix decoding (``fastdecode/decoding/suffix.py``; SuffixDecoding, Oliaro et al.,
    NeurIPS 2025). ``max_depth``: the suffix index's depth (the longest match is ``max_depth - 1`` tokens, and
    the longest draft path ``max_depth - 1`` too); ``min_match``: a shorter match drafts nothing; ``tree``:
    draft token trees (the best-first tree of the index) instead of the most frequent chain (the speculative
    loop must verify trees: ``Draft.parents``); ``min_prob``: a branch whose estimated probability (product of
    frequency ratios) falls under it is not drafted (SuffixDecoding's ``min_token_prob``); ``global_size``:
    the outputs of earlier calls of this process kept in the global index (the oldest evicted first; 0: no
    global index); ``corpus``: a suffix index file (``fastdecode-suffix-index``), read only, or null;
    ``eos``: ``before`` (an EOS is never drafted) or ``after`` (it may end a branch); ``first``: with
    ``decoder.chain=true``, suffix decoding is the chain's first stage instead of prompt lookup (chains only:
    ``tree`` must be false; ``drafters.ProposerKind.proposer``)."""

    max_depth: int = 64
    min_match: int = 1
    tree: bool = False
    min_prob: float = 0.1
    global_size: int = 4096
    corpus: str | None = None
    eos: str = "before"
    first: bool = False

    def __post_init__(self) -> None:
        if self.eos not in EOS_CUTS:
            raise unknown_name_error("suffix eos", self.eos, list(EOS_CUTS), "(decoder.suffix.eos)")
        problems = {
            "max_depth": (self.max_depth >= 2, "need >= 2 (a match of 1 token and a draft of 1)"),
            "min_match": (
                1 <= self.min_match < self.max_depth,
                f"need 1 <= min_match < max_depth ({self.max_depth})",
            ),
            "min_prob": (0 <= self.min_prob <= 1, "need a probability in [0, 1]"),
            "global_size": (self.global_size >= 0, "need >= 0 (0: no global index)"),
        }
        for key, (ok, why) in problems.items():
            if not ok:
                raise ConfigError(f"decoder.suffix.{key}={getattr(self, key)!r}: {why}.")
        if self.corpus is not None and (not isinstance(self.corpus, str) or not self.corpus):
            raise ConfigError(
                f"decoder.suffix.corpus={self.corpus!r}: give the path of a suffix index file (built by "
                "fastdecode-suffix-index), or null for none."
            )


@dataclass
class Eagle3Options:
    """``decoder.eagle3``: the ``eagle3`` decoder (``fastdecode/decoding/eagle3_tree.py``). ``tree``: draft
    EAGLE-2's dynamic token trees (the speculative loop verifies them: ``Draft.parents``) instead of a chain;
    ``top_k``: the children each expanded node offers, and the nodes each level expands. False (the default):
    a chain, drafted exactly as without this group."""

    tree: bool = False
    top_k: int = 4

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ConfigError(
                f"decoder.eagle3.top_k={self.top_k}: need >= 1 (the children each expanded tree node offers)."
            )
