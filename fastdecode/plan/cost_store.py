"""Measured costs kept on disk, so that a new process does not time the model again.

One JSON file per model and machine, ``<store>/<weights fingerprint>/<machine key>.json``, an entry per
measurement key (``plan/cost.py``). ``<store>``: ``$FASTDECODE_COSTS``, else ``$FASTDECODE_CACHE/costs``
(``~/.cache/fastdecode/costs``); ``FASTDECODE_COSTS=off`` keeps nothing, ``refresh`` measures again the entries
a process uses and overwrites them. A damaged file or entry is measured again and rewritten, with a warning
naming the file. A write holds a lock beside the file (``files/locks.py``) and is atomic (``files/io.py``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fastdecode.errors import UserError
from fastdecode.files.io import atomic_write_json, cache_dir
from fastdecode.files.locks import file_lock
from fastdecode.runtime.machine import machine_key

log = logging.getLogger(__name__)

STORE_ENV = "FASTDECODE_COSTS"
STORE_FORMAT = 1
REFRESH = "refresh"
T = TypeVar("T")
_refreshed: set[tuple[Path, str]] = set()  # (file, key) measured again by this process under ``refresh``


def _setting() -> str | None:
    env = os.environ.get(STORE_ENV)
    return None if env is None else env.strip()


def store_dir() -> Path | None:
    """Where measured costs are kept (None: ``FASTDECODE_COSTS=off``; ``refresh``: the default place)."""
    env = _setting()
    if env is not None and env.lower() in ("off", "0", "false", "none", ""):
        return None
    return Path(env).expanduser() if env and env.lower() != REFRESH else cache_dir() / "costs"


def refreshing() -> bool:
    """``FASTDECODE_COSTS=refresh``: what is stored is measured again (once per process) and overwritten."""
    env = _setting()
    return env is not None and env.lower() == REFRESH


def store_file(fingerprint: str, device: Any) -> Path | None:
    root = store_dir()
    return None if root is None else root / fingerprint[:32] / f"{machine_key(device)}.json"


def _read(path: Path) -> tuple[dict, str | None]:
    """The file's entries and what is wrong with it (None: nothing; a missing file is no damage)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as err:
        return {}, f"not readable JSON ({err})"
    if not isinstance(data, dict) or data.get("format") != STORE_FORMAT:
        return {}, f"not a store of format {STORE_FORMAT}"
    entries = data.get("entries")
    return (entries, None) if isinstance(entries, dict) else ({}, "no table of entries")


def load_measured(fingerprint: str, device: Any, key: str, parse: Callable[[Any], T]) -> T | None:
    """The measurement stored under ``key`` for this model on this machine, as ``parse`` reads it; None when
    there is none, under ``refresh`` until this process stored it again, or when the file or the entry is
    damaged (``parse`` raised ``ValueError``, ``TypeError`` or ``KeyError``: logged, naming the file)."""
    path = store_file(fingerprint, device)
    if path is None or (refreshing() and (path, key) not in _refreshed):
        return None
    entries, problem = _read(path)
    if key in entries and problem is None:
        try:
            return parse(entries[key])
        except (ValueError, TypeError, KeyError) as err:
            problem = f"its entry {key!r} is damaged ({err})"
    if problem is not None:
        log.warning("measured costs in %s: %s; measuring again and rewriting it", path, problem)
    return None


def save_measured(fingerprint: str, device: Any, key: str, value: dict) -> None:
    """Keep ``value`` under ``key``, the file's other entries kept: read, changed and written under a lock
    beside the file, so that processes writing at once keep each other's entries. A store that cannot be
    written (a read-only or full disk) only loses the saving: decoding never fails for it."""
    path = store_file(fingerprint, device)
    if path is None:
        return
    if refreshing():
        _refreshed.add((path, key))
    try:
        with file_lock(path.with_name(f"{path.name}.lock"), f"the measured costs in {path}"):
            entries, _ = _read(path)
            entries[key] = value
            atomic_write_json(
                path, {"format": STORE_FORMAT, "machine": machine_key(device), "entries": entries}
            )
    except (OSError, UserError) as err:  # UserError: fastdecode.errors.DiskFullError
        log.info("measured costs not kept on disk (%s): %s", path, err)
