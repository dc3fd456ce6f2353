"""``decoder.lookup``: prompt lookup's options (n-gram drafting from a row's own text), shared by the
``prompt_lookup`` and ``lookahead`` decoders and by every chain whose first stage is prompt lookup."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.decoding.config import DecodeConfig, DrafterOptions

MATCHES = ("recent", "earliest")  # decoder.lookup.match (ngram.NgramIndex)
EOS_CUTS = ("before", "after")  # decoder.lookup.eos


@dataclass
class LookupOptions(DrafterOptions, group="lookup"):
    """``decoder.lookup``: n-gram drafting from a row's own text (``prompt_lookup``, ``lookahead``, and the
    chains with ``decoder.chain=true``).
    ``max_ngram_size``: the longest suffix looked up (transformers' ``max_matching_ngram_size``);
    ``min_ngram_size``: the shortest. The most tokens proposed is ``decoder.draft_tokens``.
    ``match``: which earlier occurrence of the row's last n tokens is continued, ``recent`` (the most recent)
    or ``earliest`` (the first, as transformers and vLLM do); ``eos``: ``before`` (a draft never holds an EOS,
    as in transformers) or ``after`` (it may end with one); the defaults' measurements are in
    docs/design/drafters.md. ``fallback_trial``: in a chain, the row-rounds the exit, adapter or draft model
    drafts before it must have paid for itself on this call's text to go on drafting
    (``fastdecode.decoding.chain.ChainProposer``); 0: it is never retired.
    ``tree`` (``prompt_lookup`` only): draft the merged continuations of up to ``occurrences`` earlier
    occurrences as one token tree (``fastdecode/drafters/lookup/tree.py``); ``shorter``: merge those of the
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

    def check_call(self, m: Any, cfg: DecodeConfig, decoder: str) -> None:
        """A chain's first stage drafts chains: a lookup tree is the ``prompt_lookup`` decoder's alone."""
        if cfg.chain:
            refuse_tree(f"decoder '{decoder}' with decoder.chain=true", cfg)


def refuse_tree(what: str, cfg: DecodeConfig) -> None:
    """Only the ``prompt_lookup`` decoder drafts a lookup tree (``decoder.lookup.tree``); ``what``: the
    decoder that refuses, as the message names it."""
    if LookupOptions.of(cfg).tree:
        raise ConfigError(
            f"decoder.lookup.tree=true: {what} drafts lookup chains only; set decoder.lookup.tree=false, or "
            "use decoder=prompt_lookup for a lookup tree."
        )
