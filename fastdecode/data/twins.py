"""Near-duplicate prompts ("twins"): one check shared by the splits, corpus files and the benchmark.

Two prompts are twins when their ``prefix_key`` is equal: lowercased, punctuation replaced by spaces,
whitespace collapsed, the first ``PREFIX_CHARS`` characters. A held-out prompt whose twin was trained on (or
answered in a corpus) gets its own answer drafted back. A corpus file records ``key_digest`` of its prompts'
keys. Why and what it finds on ShareGPT: docs/design/data.md.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable

PREFIX_CHARS = 200
DIGEST_CHARS = 16  # hex characters of a key's sha256 kept in a corpus file (64 bits)
_PUNCTUATION = re.compile(r"[^\w\s]|_")
_SPACES = re.compile(r"\s+")


def prefix_key(text: str, chars: int = PREFIX_CHARS) -> str:
    """``text`` normalised (lowercase, punctuation to spaces, whitespace collapsed), its first ``chars``
    characters; ``""`` when nothing is left (such a text has no twin)."""
    return _SPACES.sub(" ", _PUNCTUATION.sub(" ", text.lower())).strip()[:chars]


def key_digest(key: str) -> str:
    """A short, stable digest of a ``prefix_key`` (what a corpus file stores: no prompt text)."""
    return hashlib.sha256(key.encode()).hexdigest()[:DIGEST_CHARS]


def prompt_keys(texts: Iterable[str | None]) -> set[str]:
    """The non-empty prefix keys of ``texts`` (None skipped)."""
    keys = (prefix_key(text) for text in texts if text is not None)
    return {key for key in keys if key}


def prompt_digests(texts: Iterable[str | None]) -> list[str]:
    """The sorted digests of ``prompt_keys(texts)``: what a corpus file records of its prompts."""
    return sorted({key_digest(key) for key in prompt_keys(texts)})


def has_twin(text: str | None, keys: set[str], *, digests: bool = False) -> bool:
    """Whether ``text`` has a twin among ``keys`` (prefix keys, or their digests with ``digests=True``)."""
    key = prefix_key(text) if text is not None else ""
    if not key:
        return False
    return (key_digest(key) if digests else key) in keys


def drop_twins(
    records: list[dict],
    keys: set[str],
    text_of: Callable[[dict], str | None],
    *,
    digests: bool = False,
) -> tuple[list[dict], int]:
    """``(records without a twin in keys, how many were dropped)``, in order; ``text_of`` gives a record's
    prompt."""
    kept = [r for r in records if not has_twin(text_of(r), keys, digests=digests)]
    return kept, len(records) - len(kept)
