"""The indexes suffix decoding drafts from besides a row's own text (``proposer.py``): the process-wide global
index over earlier outputs, and a corpus index read from a file.

The global index holds this process's earlier ``suffix`` outputs per model, index shape and ``global_scope``
(``global_index``, ``remember``, ``reset_global_index``); ``carried`` keeps per-model state that calls carry
on (the calibration). A corpus index is loaded once per file version and checked on every use against the
model's vocabulary and, where the caller knows the tokenizer (the API, the benchmark), its fingerprint
(``corpus_index``). Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastdecode.drafters.suffix.index import SuffixIndex
from fastdecode.drafters.suffix.index_file import (
    COMMAND,
    SuffixIndexFingerprintError,
    check_fingerprint,
    index_of,
    read_header,
    whole_file,
)
from fastdecode.files.file_cache import FileCache
from fastdecode.runtime.identity import tokenizer_fingerprint
from fastdecode.runtime.model import EarlyExitModel

if TYPE_CHECKING:  # the options module checks corpora with this one
    from fastdecode.drafters.suffix.options import SuffixOptions

_GLOBAL: weakref.WeakKeyDictionary[Any, dict[tuple, SuffixIndex]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_IDS = itertools.count()
_CORPUS = FileCache(maxsize=4)  # per file version, EOS ids and EOS rule
_CARRIED: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()
_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("suffix_global_scope", default=None)


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


def carried(m: EarlyExitModel, name: str, make: Callable[[], Any]) -> Any:
    """A per-model, per-``global_scope`` object of this process that calls carry on (``make()`` the first
    time): suffix decoding's calibration, so acceptance learnt on this workload outlives one call. Statistics,
    not text: ``reset_global_index`` leaves it (no answer can leak through it)."""
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


def _load(path: Path, stop: frozenset[int], eos: str) -> tuple[Any, SuffixIndex, int]:
    """(the fingerprint the file records, its index, its largest token id); the fingerprint is compared by
    ``corpus_index`` on every use, not here (the cached index serves callers with and without a tokenizer)."""
    header, body = whole_file(path)  # a foreign, other-version or damaged file fails here, by name
    index = index_of(path, header, body, stop=stop, eos=eos)
    largest = max((max(tokens) for tokens in index.tokens.values() if tokens), default=-1)
    return header.get("fingerprint"), index, largest


def corpus_of(m: EarlyExitModel, options: SuffixOptions, stop: Iterable[int]) -> SuffixIndex | None:
    """The corpus index ``decoder.suffix.corpus`` names (``corpus_index``: loaded once per file version,
    checked against ``m``), None without one."""
    if options.corpus is None:
        return None
    return corpus_index(options.corpus, m, stop=stop, eos=options.eos)


def corpus_index(
    path: str | os.PathLike,
    m: EarlyExitModel,
    *,
    stop: Iterable[int] = (),
    eos: str = "before",
    fingerprint: dict | None = None,
) -> SuffixIndex:
    """The corpus index in the file ``path``, loaded once per file version, checked on every call against
    ``m``'s vocabulary (its size, and the file's token ids below it) and against ``fingerprint``
    (``corpus_fingerprint`` of the tokenizer decoding uses), whenever the caller knows that tokenizer: the API
    and the benchmark pass it. Without one (a decoder called with a ``DecodeConfig``, which knows the model
    only) only the vocabulary size is checked: a file built by another tokenizer of the same size passes.
    A damaged, foreign or other-version file raises its ``SuffixIndexError`` subclass. The index is shared by
    every model and thread that reads the file: its own lock guards it (``SuffixIndex.lock``)."""
    path = Path(path)
    stop = frozenset(int(t) for t in stop)
    if not path.is_file():
        read_header(path)  # raises NotASuffixIndexError, which says how to build one
    found, index, largest = _CORPUS.get([path], lambda: _load(path, stop, eos), key=(stop, eos))
    size = found.get("vocab_size") if isinstance(found, dict) else None
    if not isinstance(size, int) or size > m.vocab_size or largest >= m.vocab_size:
        raise SuffixIndexFingerprintError(
            f"suffix index {str(path)!r} was built for another vocabulary (fingerprint {found!r}, token ids up "
            f"to {largest}) than this model's {m.vocab_size} ids: rebuild it with this model's tokenizer and "
            f"{COMMAND}."
        )
    if fingerprint is not None:
        check_fingerprint(path, found, fingerprint)
    return index
