"""``decoder.suffix``: suffix decoding's options (the indexes, the draft's shape, the corpus, first stage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.decoding.config import DecodeConfig, DrafterOptions
from fastdecode.drafters.suffix.sources import corpus_of

EOS_CUTS = ("before", "after")  # decoder.suffix.eos


@dataclass
class SuffixOptions(DrafterOptions, group="suffix"):
    """``decoder.suffix``: suffix decoding (``fastdecode/drafters/suffix/proposer.py``; SuffixDecoding, Oliaro et al.,
    NeurIPS 2025). ``max_depth``: the suffix index's depth (the longest match is ``max_depth - 1`` tokens, and
    the longest draft path ``max_depth - 1`` too); ``min_match``: a shorter match drafts nothing; ``tree``:
    draft token trees (the best-first tree of the index) instead of the most frequent chain (the speculative
    loop must verify trees: ``Draft.parents``); ``min_prob``: a branch whose estimated probability (product of
    frequency ratios) falls under it is not drafted (SuffixDecoding's ``min_token_prob``); ``global_size``:
    the outputs of earlier calls of this process kept in the global index (the oldest evicted first; 0: no
    global index); ``corpus``: a suffix index file (``fastdecode-suffix-index``), read only, or null;
    ``eos``: ``before`` (an EOS is never drafted) or ``after`` (it may end a branch); ``first``: with
    ``decoder.chain=true``, suffix decoding is the chain's first stage instead of prompt lookup (chains only:
    ``tree`` must be false; ``check_call``)."""

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

    def check_call(self, m: Any, cfg: DecodeConfig, decoder: str) -> None:
        """``first``: only in a chain, drafting chains, over a corpus that fits the model."""
        if not self.first:
            return
        if not cfg.chain:
            raise ConfigError(
                f"decoder.suffix.first=true puts suffix decoding first in a chain: set decoder.chain=true (with "
                f"'self_speculative', 'assisted' or 'eagle3'), or decoder.suffix.first=false (decoder '{decoder}')."
            )
        if self.tree:
            raise ConfigError(
                "decoder.suffix.tree=true: a chain's first stage drafts chains only (the drafter that follows "
                "drafts chains); set decoder.suffix.tree=false with decoder.suffix.first=true."
            )
        corpus_of(m, self, cfg.eos_ids)
