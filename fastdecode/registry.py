"""Every decoder by name: the loop's strategies and each drafter package's kind, registered here and nowhere else.

A decoder is a free function ``(m, prompts, cfg, draft=None) -> DecodeOutput``; ``get_decoder(name)`` finds it.
This module fills the loop's plugin tables (``decoding.kinds.PROPOSERS``, ``FIRST_STAGES``): adding a drafter
is its package and one line in ``KINDS`` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import contextlib
import functools
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from fastdecode.config import unknown_name_error
from fastdecode.decoding import autoregressive, jacobi, skipdecode
from fastdecode.decoding.config import DecodeConfig, DecodeOutput, merged_options, typed_groups
from fastdecode.decoding.kinds import DEFAULT_FIRST, FIRST_STAGES, PROPOSERS, FirstStageKind, Setup
from fastdecode.drafters.dflash import kind as dflash
from fastdecode.drafters.dflash.files import read_dflash_config
from fastdecode.drafters.draft_model import kind as draft_model
from fastdecode.drafters.eagle3 import kind as eagle3
from fastdecode.drafters.eagle3.files import read_eagle3_config
from fastdecode.drafters.exits import kind as exits
from fastdecode.drafters.lookup import kind as lookup
from fastdecode.drafters.lookup import lookahead
from fastdecode.drafters.lookup.ngram import PromptLookupProposer
from fastdecode.drafters.lookup.options import LookupOptions
from fastdecode.drafters.suffix import proposer as suffix
from fastdecode.drafters.suffix import sources as suffix_sources
from fastdecode.drafters.suffix.index import SuffixIndex
from fastdecode.drafters.suffix.index_file import header_of, save_index
from fastdecode.drafters.suffix.options import SuffixOptions
from fastdecode.runtime.model import EarlyExitModel


class Decoder(Protocol):
    def __call__(
        self,
        m: EarlyExitModel,
        prompts: list[list[int]],
        cfg: DecodeConfig,
        draft: EarlyExitModel | None = None,
    ) -> DecodeOutput: ...


# The kinds of draft the one speculative loop verifies: each is a decoder of its name, and ``auto``
# (fastdecode/plan/choose.py) plans with the ones that make offers.
KINDS = [exits.KIND, draft_model.KIND, lookup.KIND, lookahead.KIND, eagle3.KIND, dflash.KIND, suffix.KIND]
PROPOSERS.update({kind.name: kind for kind in KINDS})


def lookup_first(s: Setup) -> PromptLookupProposer:
    return PromptLookupProposer(s.prompts, s.cfg, s.costs, s.m.vocab_size)


def suffix_first(s: Setup) -> suffix.SuffixProposer:
    """Suffix decoding first in a chain; its fallback is judged after ``decoder.lookup.fallback_trial``
    row-rounds, as with prompt lookup first (the chain's one trial option)."""
    return suffix.SuffixProposer(s, trial=LookupOptions.of(s.cfg).fallback_trial)


# A chain's first stages: prompt lookup by default, suffix decoding with ``decoder.suffix.first``.
FIRST_STAGES.update(
    {
        DEFAULT_FIRST: FirstStageKind(lookup_first, selects=lambda cfg: False),
        "suffix": FirstStageKind(suffix_first, selects=lambda cfg: SuffixOptions.of(cfg).first),
    }
)


def locked(decoder: Decoder) -> Decoder:
    """``decoder`` holding its models' locks for the whole call (``runtime.model_lock``; a draft model's too,
    taken in one order): calls on one model from several threads run one at a time, each as it would alone.
    The output names the weights the products read (``DecodeOutput.weights``)."""

    @functools.wraps(decoder)
    def call(
        m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
    ):
        locks = {id(x.lock): x.lock for x in (m, draft) if x is not None}
        with contextlib.ExitStack() as held:
            for _, lock in sorted(locks.items()):
                held.enter_context(lock)
            out = decoder(m, prompts, cfg, draft)
            if isinstance(out, DecodeOutput):
                out.weights = m.engine.options.weights.label if m.engine is not None else "fp32 (HF modules)"
            return out

    return call


# Every decoding strategy by name: the ones that are not speculation, then each proposer kind.
DECODERS: dict[str, Decoder] = {
    "autoregressive": locked(autoregressive.generate),
    "skipdecode": locked(skipdecode.generate),
    "jacobi": locked(jacobi.generate),
    **{name: locked(kind.generate) for name, kind in PROPOSERS.items()},
}


def decoder_names() -> list[str]:
    """Every decoder a method may name: the strategies and the proposer kinds."""
    return list(dict.fromkeys([*DECODERS, *PROPOSERS]))


def get_decoder(name: str) -> Decoder:
    """The strategy or proposer kind registered as ``name``; an unknown name (or not a string) raises a
    ConfigError listing the choices."""
    if isinstance(name, str) and name in DECODERS:
        return DECODERS[name]
    if isinstance(name, str) and name in PROPOSERS:  # a kind registered after import
        return locked(PROPOSERS[name].generate)
    raise unknown_name_error("decoder", str(name), decoder_names(), "(fastdecode.registry)")


# --------------------------------------------------------------------------------------------------------
# What callers above the loop (the API, the benchmark) need of the drafters' files and memories


def drafter_kind(path: str | Path) -> str:
    """The decoder a trained drafter's directory (``drafter=``) drafts for, told by its ``config.json``'s
    ``architectures``: ``"dflash"`` for a DFlash drafter, else ``"eagle3"`` (an EAGLE-3 head; a missing or
    foreign directory too, which ``check_drafter`` then refuses by name)."""
    return dflash.NAME if dflash.is_dflash_directory(path) else eagle3.NAME


def check_drafter(path: str | Path) -> str:
    """A trained drafter's directory (``drafter=``), read without its weights: a missing, damaged or foreign
    one is refused by name (an EAGLE-3 head, ``drafters.eagle3.files``, or a DFlash drafter,
    ``drafters.dflash.files``); returns its kind (``drafter_kind``), the decoder that drafts with it."""
    kind = drafter_kind(path)
    (read_dflash_config if kind == dflash.NAME else read_eagle3_config)(path)
    return kind


def check_corpus_file(path: str | Path) -> None:
    """A suffix index file (``corpus=``), its header line read alone (not the body, not the tokenizer's
    fingerprint: ``load_corpus``): a missing, foreign or other-version file fails."""
    header_of(Path(path))


def corpus_fingerprint(tokenizer: Any) -> dict:
    """What a corpus records of the tokenizer that made its ids (hash it once per tokenizer)."""
    return suffix_sources.corpus_fingerprint(tokenizer)


def load_corpus(corpus: str | Path, m: EarlyExitModel, fingerprint: dict, suffix: Any = None) -> None:
    """Load a corpus file for decoding, checked against the model's vocabulary, the tokenizer's
    ``fingerprint`` (the tokenizer decoding uses) and the size bound of the given ``suffix`` options (a
    mapping, ``SuffixOptions`` or None: ``max_corpus_bytes``): a damaged, foreign, other-tokenizer or too
    large file is refused by name, a too large one before it is read. Loaded once per file version: decoding
    then drafts from that same load, whatever its EOS ids."""
    bound = typed_groups({"suffix": suffix if suffix is not None else {}})["suffix"].max_corpus_bytes
    suffix_sources.corpus_index(corpus, m, fingerprint=fingerprint, max_bytes=bound)


def named_corpus(options: dict) -> str | None:
    """The corpus file a method's options (``DecodeConfig`` fields) name in their ``suffix`` group, or None:
    what a caller that knows the tokenizer checks with ``load_corpus`` before decoding (a decoder knows the
    model only, so it checks the vocabulary size alone)."""
    group = options.get("suffix")
    return None if group is None else typed_groups({"suffix": group})["suffix"].corpus


def corpus_prompt_keys(path: str | Path) -> list[str] | None:
    """The twin-key digests of the prompts a corpus file answers (``data.twins``), None when it records none."""
    return header_of(Path(path)).get("prompt_keys")


def save_corpus(
    path: str | Path, sequences: list[list[int]], *, fingerprint: dict, prompt_keys: list[str], max_depth: int
) -> dict:
    """A corpus file of token-id ``sequences`` (empty ones skipped), written atomically with the tokenizer's
    ``fingerprint`` and ``prompt_keys`` in its header; returns its counts."""
    index = SuffixIndex(max_depth)
    for i, ids in enumerate(sequences):
        if ids:
            index.add(i, [int(t) for t in ids])
    save_index(path, index, fingerprint=fingerprint, prompt_keys=prompt_keys)
    return {"sequences": len(index), "tokens": sum(len(t) for t in index.tokens.values())}


def corpus_options(options: dict, corpus: str | Path) -> dict:
    """``options`` (a method's ``DecodeConfig`` fields) with ``decoder.suffix.corpus`` set to ``corpus``."""
    return merged_options(options, {"suffix": {"corpus": str(corpus)}})


def forget_earlier_calls() -> None:
    """Forget the text drafters keep from earlier calls of this process (suffix decoding's global index):
    a benchmark pass over prompts whose answers must not be drafted back to them."""
    suffix_sources.reset_global_index()


def memory_scope(name: str | None) -> AbstractContextManager[None]:
    """Calls inside keep the text of earlier calls apart under ``name`` (None: the process's shared memory)."""
    return suffix_sources.global_scope(name)


__all__ = [
    "DECODERS",
    "PROPOSERS",
    "Decoder",
    "load_corpus",
    "check_corpus_file",
    "named_corpus",
    "corpus_options",
    "corpus_prompt_keys",
    "save_corpus",
    "check_drafter",
    "drafter_kind",
    "corpus_fingerprint",
    "decoder_names",
    "forget_earlier_calls",
    "get_decoder",
    "memory_scope",
]
