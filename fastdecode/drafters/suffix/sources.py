"""The indexes suffix decoding drafts from besides a row's own text (``proposer.py``): the process-wide global
index over earlier outputs, and a corpus index read from a file.

The global index holds this process's earlier ``suffix`` outputs per model, index shape and ``global_scope``
(``global_index``, ``remember``, ``reset_global_index``); ``carried`` keeps the calibrations calls carry on.
A corpus file within ``max_corpus_bytes`` is loaded once per file version whatever the caller's EOS ids
(``corpus.CorpusIndex``), checked on every use against the model's vocabulary and, where the caller knows the
tokenizer, its fingerprint (``corpus_index``). Design notes: docs/design/drafters.md."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastdecode.drafters.suffix.corpus import CorpusIndex
from fastdecode.drafters.suffix.index import SuffixIndex
from fastdecode.drafters.suffix.index_file import (
    COMMAND,
    SuffixIndexError,
    SuffixIndexFingerprintError,
    check_fingerprint,
    header_of,
    index_of,
    whole_file,
)
from fastdecode.errors import human_bytes
from fastdecode.files.file_cache import FileCache
from fastdecode.runtime.identity import tokenizer_fingerprint
from fastdecode.runtime.model import EarlyExitModel

if TYPE_CHECKING:  # the options module checks corpora with this one
    from fastdecode.drafters.suffix.options import SuffixOptions

_GLOBAL: weakref.WeakKeyDictionary[Any, dict[tuple, SuffixIndex]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_IDS = itertools.count()
_CORPUS = FileCache(maxsize=4)  # per file version (a caller's EOS ids and rule: ``CorpusIndex.drafting``)
_CARRIED: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()
_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("suffix_global_scope", default=None)
MAX_CORPUS_BYTES = 1 << 30  # decoder.suffix.max_corpus_bytes' default: 1 GiB (about 5 GiB once loaded)


class SuffixIndexTooLargeError(SuffixIndexError):
    """The file is larger than ``decoder.suffix.max_corpus_bytes``: it was not read."""


@contextlib.contextmanager
def global_scope(name: str | None) -> Iterator[None]:
    """Calls inside use the global indexes of scope ``name`` (None: the process's shared one)."""
    token = _SCOPE.set(name)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def corpus_fingerprint(tokenizer: Any) -> dict:
    """What a corpus index records of the tokenizer that made its token ids: the vocabulary's size and hash
    (``identity.tokenizer_fingerprint`` without the name, which depends on the path it was loaded from)."""
    found = tokenizer_fingerprint(tokenizer)
    return {"vocab_size": found["vocab_size"], "vocab_hash": found["vocab_hash"]}


def global_index(m: EarlyExitModel, options: SuffixOptions, stop: Iterable[int]) -> SuffixIndex | None:
    """The global index of ``m`` for these options (created empty; at most ``global_size`` outputs and
    ``global_tokens`` tokens), None with ``global_size=0``. Shared by threads: its own lock guards it."""
    if options.global_size == 0:
        return None
    stop = frozenset(int(t) for t in stop)
    size, tokens = options.global_size, options.global_tokens
    key = (_SCOPE.get(), options.max_depth, size, tokens, stop, options.eos)
    with _LOCK:
        indexes = _GLOBAL.setdefault(m.hf, {})
        if key not in indexes:
            indexes[key] = SuffixIndex(
                options.max_depth, max_sequences=size, max_tokens=tokens, stop=stop, eos=options.eos
            )
        return indexes[key]


def remember(
    m: EarlyExitModel, options: SuffixOptions, stop: Iterable[int], outputs: list[list[int]]
) -> None:
    """Add each row's ``outputs`` (a finished call's new tokens) to the global index of ``m`` (at once, under
    the index's lock)."""
    index = global_index(m, options, stop)
    if index is None:
        return
    with index.lock:
        for tokens in outputs:
            if tokens:
                index.add(next(_IDS), tokens)


def carried(m: EarlyExitModel, name: Hashable, make: Callable[[], Any]) -> Any:
    """A per-model, per-``global_scope`` object of this process that calls carry on, one per ``name``
    (``make()`` the first time): suffix decoding's calibrations, so acceptance learnt on this workload
    outlives one call. Statistics, not text: ``reset_global_index`` leaves them (no answer can leak through
    them)."""
    key = (_SCOPE.get(), name)
    with _LOCK:
        states = _CARRIED.setdefault(m.hf, {})
        if key not in states:
            states[key] = make()
        return states[key]


def reset_global_index() -> None:
    """Empty every global index of this process (every model's)."""
    with _LOCK:
        _GLOBAL.clear()


def global_sizes() -> dict[int, int]:
    """Sequences held per global index (by ``id`` of the index), for tests and reports."""
    with _LOCK:
        return {id(index): len(index) for indexes in _GLOBAL.values() for index in indexes.values()}


def _load(path: Path) -> tuple[Any, CorpusIndex, int]:
    """(the fingerprint the file records, its index, its largest token id); the fingerprint is compared by
    ``corpus_index`` on every use, not here (the cached index serves callers with and without a tokenizer)."""
    header, body = whole_file(path)  # a foreign, other-version or damaged file fails here, by name
    index = index_of(path, header, body, kind=CorpusIndex)
    largest = max((max(tokens) for tokens in index.tokens.values() if tokens), default=-1)
    return header.get("fingerprint"), index, largest


def check_size(path: Path, max_bytes: int) -> None:
    """Refuse, before reading it, a corpus file over ``max_bytes`` (``decoder.suffix.max_corpus_bytes``)."""
    size = path.stat().st_size
    if size > max_bytes:
        raise SuffixIndexTooLargeError(
            f"suffix index {str(path)!r} is {human_bytes(size)} ({size} bytes), over the bound "
            f"decoder.suffix.max_corpus_bytes={max_bytes} ({human_bytes(max_bytes)}; Python: "
            f"suffix={{'max_corpus_bytes': N}}): a corpus is read whole into memory, where it takes several "
            f"times its size. Raise the bound where this machine's memory holds it, or build a smaller "
            f"corpus with {COMMAND}."
        )


def corpus_of(m: EarlyExitModel, options: SuffixOptions, stop: Iterable[int]) -> CorpusIndex | None:
    """The corpus index ``decoder.suffix.corpus`` names (``corpus_index``: loaded once per file version,
    checked against ``m`` and ``max_corpus_bytes``), drafting with ``stop`` and ``eos``; None without one."""
    if options.corpus is None:
        return None
    return corpus_index(options.corpus, m, stop=stop, eos=options.eos, max_bytes=options.max_corpus_bytes)


def corpus_index(
    path: str | os.PathLike,
    m: EarlyExitModel,
    *,
    stop: Iterable[int] = (),
    eos: str = "before",
    fingerprint: dict | None = None,
    max_bytes: int = MAX_CORPUS_BYTES,
) -> CorpusIndex:
    """The corpus index in the file ``path`` drafting with the EOS ids ``stop`` and the rule ``eos``: a view
    (``CorpusIndex.drafting``) of the one index loaded per file version, whatever the caller's EOS ids. A file
    over ``max_bytes`` is refused before it is read. Checked on every call against ``m``'s vocabulary (its
    size, and the file's token ids below it) and against ``fingerprint`` (``corpus_fingerprint`` of the
    tokenizer decoding uses), whenever the caller knows that tokenizer: the API and the benchmark pass it.
    Without one (a decoder called with a ``DecodeConfig``, which knows the model only) only the vocabulary size
    is checked: a file built by another tokenizer of the same size passes. A damaged, foreign or other-version
    file raises its ``SuffixIndexError`` subclass. The index is shared by every model, thread and call that
    reads the file, and read only: queries do not grow it (``CorpusIndex``)."""
    path = Path(path)
    if not path.is_file():
        header_of(path)  # raises NotASuffixIndexError, which says how to build one
    check_size(path, max_bytes)
    found, index, largest = _CORPUS.get([path], lambda: _load(path))
    size = found.get("vocab_size") if isinstance(found, dict) else None
    if not isinstance(size, int) or size > m.vocab_size or largest >= m.vocab_size:
        raise SuffixIndexFingerprintError(
            f"suffix index {str(path)!r} was built for another vocabulary (fingerprint {found!r}, token ids up "
            f"to {largest}) than this model's {m.vocab_size} ids: rebuild it with this model's tokenizer and "
            f"{COMMAND}."
        )
    if fingerprint is not None:
        check_fingerprint(path, found, fingerprint)
    return index.drafting(stop, eos)
