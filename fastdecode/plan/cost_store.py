"""Measured costs kept on disk, so that a new process does not time the model again.

One JSON file per model and machine: ``<store>/<weights fingerprint>/<machine key>.json`` holding, per
measurement key (the execution engine, the thread count, the batch size and what was measured), the measured
tables. ``<store>`` is ``$FASTDECODE_COSTS`` when set, else ``$FASTDECODE_CACHE/costs`` (default
``~/.cache/fastdecode/costs``); ``FASTDECODE_COSTS=off`` keeps nothing on disk. A file that cannot be read
(damaged, another format) is ignored and written again: what it held is only a measurement, redone in seconds.
Writes are atomic (``fastdecode.files.io``): a killed process leaves the previous file or the new one.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from fastdecode.errors import UserError
from fastdecode.files.io import atomic_write_json, cache_dir
from fastdecode.runtime.machine import machine_key

log = logging.getLogger(__name__)

STORE_ENV = "FASTDECODE_COSTS"
STORE_FORMAT = 1


def store_dir() -> Path | None:
    """Where measured costs are kept (None: ``FASTDECODE_COSTS=off``)."""
    env = os.environ.get(STORE_ENV)
    if env is not None and env.strip().lower() in ("off", "0", "false", "none", ""):
        return None
    return Path(env).expanduser() if env else cache_dir() / "costs"


def store_file(fingerprint: str, device: Any) -> Path | None:
    root = store_dir()
    return None if root is None else root / fingerprint[:32] / f"{machine_key(device)}.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != STORE_FORMAT:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def load_measured(fingerprint: str, device: Any, key: str) -> dict | None:
    """The measurement stored under ``key`` for this model on this machine, or None."""
    path = store_file(fingerprint, device)
    if path is None or not path.is_file():
        return None
    found = _read(path).get(key)
    return found if isinstance(found, dict) else None


def save_measured(fingerprint: str, device: Any, key: str, value: dict) -> None:
    """Keep ``value`` under ``key`` (the file's other entries kept). A store that cannot be written (a
    read-only or full disk) only loses the saving: decoding never fails for it."""
    path = store_file(fingerprint, device)
    if path is None:
        return
    try:
        entries = _read(path) if path.is_file() else {}
        entries[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"format": STORE_FORMAT, "machine": machine_key(device), "entries": entries})
    except (OSError, UserError) as err:  # UserError: fastdecode.errors.DiskFullError
        log.info("measured costs not kept on disk (%s): %s", path, err)
