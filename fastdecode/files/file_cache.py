"""``FileCache``: objects loaded from files, kept until a file changes. The one cache of anything read from disk.

An entry is looked up by the files' resolved paths (and a key of the caller's) and is valid while every file
keeps its size and modification time (``file_identity``); a rewritten file is loaded again. With ``owner``,
entries are held per owner, weakly. Details, and what is cached elsewhere: docs/design/files.md.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def file_identity(paths: Sequence[str | os.PathLike]) -> tuple[tuple[str, int, int], ...]:
    """``(resolved path, size, mtime_ns)`` of each file; OSError when one is missing."""
    identity = []
    for path in paths:
        resolved = Path(path).resolve()
        stat = resolved.stat()
        identity.append((str(resolved), stat.st_size, stat.st_mtime_ns))
    return tuple(identity)


class FileCache:
    """The ``maxsize`` most recently used objects loaded from files (per owner, when one is given).

    ``get(paths, load, key=..., owner=...)`` returns the cached object while ``paths`` keep their identity,
    else ``load()``'s result, which it keeps.
    """

    def __init__(self, maxsize: int = 8) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._shared: OrderedDict[Hashable, tuple[tuple, Any]] = OrderedDict()
        self._owned: weakref.WeakKeyDictionary[Any, OrderedDict] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(
        self,
        paths: Sequence[str | os.PathLike],
        load: Callable[[], T],
        key: Hashable = (),
        owner: Any = None,
    ) -> T:
        identity = file_identity(paths)
        slot = (tuple(path for path, _, _ in identity), key)
        with self._lock:
            entries = self._entries(owner)
            found = entries.get(slot)
            if found is not None and found[0] == identity:
                entries.move_to_end(slot)
                return found[1]
        value = load()  # outside the lock: loading may take a while, and may raise (nothing is kept then)
        with self._lock:
            entries = self._entries(owner)
            entries[slot] = (identity, value)
            entries.move_to_end(slot)
            while len(entries) > self.maxsize:
                entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        """The number of entries held, every owner's included."""
        with self._lock:
            return len(self._shared) + sum(len(entries) for entries in self._owned.values())

    def clear(self) -> None:
        with self._lock:
            self._shared.clear()
            self._owned.clear()

    def _entries(self, owner: Any) -> OrderedDict:
        if owner is None:
            return self._shared
        entries = self._owned.get(owner)
        if entries is None:
            entries = self._owned[owner] = OrderedDict()
        return entries
