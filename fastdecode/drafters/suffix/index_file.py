"""The suffix index file (a corpus for suffix drafting, built once): ``save_index`` / ``load_index``.

A file is one line of JSON, the header, then the body: little-endian int64 arrays of ``SuffixIndex.state``.
A sha256 covers both, the file is written atomically, and ``load_index`` refuses a foreign, other-version,
damaged or other-tokenizer file, each with its own ``SuffixIndexError`` subclass. Design notes:
docs/design/drafters.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from fastdecode.drafters.suffix.index import SuffixIndex
from fastdecode.errors import UserError
from fastdecode.files.io import atomic_path

FORMAT = "fastdecode-suffix-index"
VERSION = 1
COLUMNS = ("lengths", "tokens", "parent", "token", "count", "ref_seq", "ref_end")
# How a user builds a corpus file (fastdecode_cli/suffix_index.py), named by every error below
COMMAND = "the fastdecode-suffix-index command (fastdecode-suffix-index model=MODEL input=ANSWERS.jsonl output=PATH)"
REBUILD = f"rebuild it with {COMMAND}"


class SuffixIndexError(UserError):
    """A suffix index file that cannot be used; the subclasses say why."""


class NotASuffixIndexError(SuffixIndexError):
    """The file is missing or is not a suffix index file (no header of our format)."""


class SuffixIndexVersionError(SuffixIndexError):
    """The file is a suffix index of another format version."""


class SuffixIndexDamagedError(SuffixIndexError):
    """The file is truncated or its checksum does not match: it was damaged after it was written."""


class SuffixIndexFingerprintError(SuffixIndexError):
    """The file was built for another tokenizer (its token ids mean other text)."""


def canonical(fingerprint: Any) -> Any:
    """``fingerprint`` as JSON gives it back (so a tuple and a list, or dicts in any order, compare equal)."""
    return json.loads(json.dumps(fingerprint, sort_keys=True))


def digest(header: dict[str, Any], body: bytes) -> str:
    """The sha256 of ``header`` (without its ``sha256``) and ``body``."""
    fields = {k: v for k, v in header.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode() + body).hexdigest()


def save_index(
    path: str | os.PathLike, index: SuffixIndex, *, fingerprint: Any, prompt_keys: list[str] | None = None
) -> Path:
    """Write ``index`` to ``path`` atomically; ``fingerprint`` (JSON: e.g. ``identity.tokenizer_fingerprint``
    of the tokenizer that made the token ids) is what ``load_index`` will require. Sequence ids must be ints
    or strings (they go into the JSON header). ``prompt_keys``: strings identifying the prompts the corpus
    answers (the header's ``prompt_keys``, so an evaluation can exclude them; absent: not recorded)."""
    state = index.state()
    if not all(isinstance(i, (int, str)) for i in state["ids"]):
        raise ValueError("suffix index files keep sequence ids that are ints or strings")
    body = b"".join(np.asarray(state[c], dtype="<i8").tobytes() for c in COLUMNS)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "max_depth": index.max_depth,
        "max_sequences": index.max_sequences,
        "fingerprint": canonical(fingerprint),
        "sequences": len(state["ids"]),
        "tokens": len(state["tokens"]),
        "nodes": len(state["parent"]),
        "ids": state["ids"],
        "body_bytes": len(body),
    }
    if prompt_keys is not None:
        header["prompt_keys"] = sorted(set(prompt_keys))
    header["sha256"] = digest(header, body)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n" + body)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def read_header(path: Path) -> tuple[dict[str, Any], bytes]:
    """``(header, body)`` of a file of our format and version; else the named error."""
    header = header_of(path)
    try:
        return header, path.read_bytes().partition(b"\n")[2]
    except OSError as err:
        raise unreadable(path, err) from err


def unreadable(path: Path, err: OSError) -> NotASuffixIndexError:
    """The error for a file that cannot be read (missing, a directory, no permission)."""
    return NotASuffixIndexError(
        f"suffix index {str(path)!r}: cannot read it ({err}); build or rebuild it with {COMMAND}."
    )


def header_of(path: Path) -> dict[str, Any]:
    """The header of a file of our format and version, its first line read alone (not the body); else the
    named error."""
    try:
        with open(path, "rb") as f:
            line = f.readline()
    except OSError as err:
        raise unreadable(path, err) from err
    try:
        header = json.loads(line)
        found = header.get("format") if isinstance(header, dict) else None
    except (ValueError, UnicodeDecodeError):
        found = None
    if found != FORMAT:
        raise NotASuffixIndexError(
            f"suffix index {str(path)!r} is not a suffix index file (no {FORMAT!r} header: another file, "
            f"or its header was damaged); {REBUILD}."
        )
    if header.get("version") != VERSION:
        raise SuffixIndexVersionError(
            f"suffix index {str(path)!r} has format version {header.get('version')!r}; this fastdecode reads "
            f"version {VERSION}: {REBUILD} (or use the fastdecode that wrote it)."
        )
    return header


def check_fingerprint(path: Path, found: Any, fingerprint: Any) -> None:
    """Refuse a file whose recorded fingerprint ``found`` is not ``fingerprint`` (the tokenizer the caller's
    token ids come from)."""
    if canonical(found) != canonical(fingerprint):
        raise SuffixIndexFingerprintError(
            f"suffix index {str(path)!r} was built for another tokenizer (fingerprint {found!r}, not "
            f"{canonical(fingerprint)!r}): its token ids mean other text. Rebuild it with this model's tokenizer "
            f"and {COMMAND}, or give the index built for it."
        )


def load_index(
    path: str | os.PathLike, *, fingerprint: Any, stop: Iterable[int] = (), eos: str = "before"
) -> SuffixIndex:
    """The index saved at ``path``, checked whole (format, version, length, checksum) and against
    ``fingerprint`` (the tokenizer the caller's token ids come from); ``stop``/``eos``: as ``SuffixIndex``."""
    path = Path(path)
    header, body = whole_file(path)
    check_fingerprint(path, header["fingerprint"], fingerprint)
    return index_of(path, header, body, stop=stop, eos=eos)


def whole_file(path: Path) -> tuple[dict[str, Any], bytes]:
    """``(header, body)`` of a file of our format and version whose length and checksum match; its
    fingerprint is not checked here (``check_fingerprint``: ``load_index``, or a caller that compares it on
    every use of a cached index)."""
    header, body = read_header(path)
    problem = None
    if len(body) != header.get("body_bytes"):
        problem = (
            f"truncated or padded: its body has {len(body)} bytes, its header says {header.get('body_bytes')}"
        )
    elif digest(header, body) != header.get("sha256"):
        problem = "its checksum does not match its content"
    if problem:
        raise SuffixIndexDamagedError(f"suffix index {str(path)!r} is damaged ({problem}); {REBUILD}.")
    return header, body


def index_of(
    path: Path,
    header: dict[str, Any],
    body: bytes,
    *,
    stop: Iterable[int] = (),
    eos: str = "before",
    kind: type[SuffixIndex] = SuffixIndex,
) -> SuffixIndex:
    """The index a ``whole_file`` describes, a ``kind`` (a corpus: ``corpus.CorpusIndex``); ``stop``/``eos``:
    as ``SuffixIndex``."""
    arrays = np.frombuffer(body, dtype="<i8")
    sizes = [header["sequences"], header["tokens"]] + [header["nodes"]] * 5
    state: dict[str, list[Any]] = {"ids": header["ids"]}
    for column, start, size in zip(COLUMNS, np.cumsum([0, *sizes[:-1]]), sizes, strict=True):
        state[column] = arrays[start : start + size].tolist()
    try:
        return kind.from_state(
            state, header["max_depth"], max_sequences=header["max_sequences"], stop=stop, eos=eos
        )
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise SuffixIndexDamagedError(
            f"suffix index {str(path)!r} does not describe an index ({err}); {REBUILD}."
        ) from err
