"""``decoder.suffix``: suffix decoding's options (the indexes, the draft's shape, the corpus, first stage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.decoding.config import DecodeConfig, DrafterOptions
from fastdecode.drafters.suffix.sources import MAX_CORPUS_BYTES, corpus_of

EOS_CUTS = ("before", "after")  # decoder.suffix.eos


def _named(key: str, value: Any) -> str:
    """``decoder.suffix.KEY=VALUE`` as a config or command line sets it, then as ``generate`` takes it: a
    message names the option in both forms, whichever the caller typed."""
    shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    return f"decoder.suffix.{key}={shown} (Python: suffix={{{key!r}: {value!r}}})"


@dataclass
class SuffixOptions(DrafterOptions, group="suffix"):
    """``decoder.suffix``: suffix decoding (``fastdecode/drafters/suffix/proposer.py``; SuffixDecoding, Oliaro et al.,
    NeurIPS 2025). ``max_depth``: the suffix index's depth (the longest match is ``max_depth - 1`` tokens, and
    the longest draft path ``max_depth - 1`` too); ``min_match``: a shorter match drafts nothing; ``tree``:
    draft token trees (the best-first tree of the index) instead of the most frequent chain (the speculative
    loop must verify trees: ``Draft.parents``); ``min_prob``: a branch whose estimated probability (product of
    frequency ratios) falls under it is not drafted (SuffixDecoding's ``min_token_prob``); ``global_size``:
    the outputs of earlier calls of this process kept in the global index (the oldest evicted first; 0: no
    global index); ``global_tokens``: the tokens it keeps at most (its memory grows with them; the oldest
    outputs evicted first); ``corpus``: a suffix index file (``fastdecode-suffix-index``), read only, or null;
    ``max_corpus_bytes``: a larger corpus file is refused before it is read (loaded, it takes several times
    its size in memory); ``eos``: ``before`` (an EOS is never drafted) or ``after`` (it may end a branch);
    ``first``: with ``decoder.chain=true``, suffix decoding is the chain's first stage instead of prompt
    lookup (chains only: ``tree`` must be false; ``check_call``)."""

    max_depth: int = 64
    min_match: int = 1
    tree: bool = False
    min_prob: float = 0.1
    global_size: int = 4096
    global_tokens: int = 1_000_000
    corpus: str | None = None
    max_corpus_bytes: int = MAX_CORPUS_BYTES
    eos: str = "before"
    first: bool = False

    def __post_init__(self) -> None:
        if self.eos not in EOS_CUTS:
            raise unknown_name_error(
                "suffix eos", self.eos, list(EOS_CUTS), "(decoder.suffix.eos; Python: suffix={'eos': ...})"
            )
        problems = {
            "max_depth": (self.max_depth >= 2, "need >= 2 (a match of 1 token and a draft of 1)"),
            "min_match": (
                1 <= self.min_match < self.max_depth,
                f"need 1 <= min_match < max_depth ({self.max_depth})",
            ),
            "min_prob": (0 <= self.min_prob <= 1, "need a probability in [0, 1]"),
            "global_size": (self.global_size >= 0, "need >= 0 (0: no global index)"),
            "global_tokens": (self.global_tokens >= 1, "need >= 1 (global_size=0: no global index)"),
            "max_corpus_bytes": (self.max_corpus_bytes >= 1, "need >= 1 (the largest corpus file read)"),
        }
        for key, (ok, why) in problems.items():
            if not ok:
                raise ConfigError(f"{_named(key, getattr(self, key))}: {why}.")
        if self.corpus is not None and (not isinstance(self.corpus, str) or not self.corpus):
            raise ConfigError(
                f"{_named('corpus', self.corpus)}: give the path of a suffix index file (built by the "
                "fastdecode-suffix-index command), or none (null; Python: None)."
            )

    def check_call(self, m: Any, cfg: DecodeConfig, decoder: str) -> None:
        """``first``: only in a chain, drafting chains, over a corpus that fits the model."""
        if not self.first:
            return
        if not cfg.chain:
            raise ConfigError(
                f"{_named('first', True)} puts suffix decoding first in a chain: set decoder.chain=true (Python: "
                f"chain=True) with 'self_speculative', 'assisted' or 'eagle3', or {_named('first', False)} "
                f"(decoder '{decoder}')."
            )
        if self.tree:
            raise ConfigError(
                f"{_named('tree', True)}: a chain's first stage drafts chains only (the drafter that follows "
                f"drafts chains); set {_named('tree', False)} with decoder.suffix.first=true."
            )
        corpus_of(m, self, cfg.eos_ids)
