"""Atomic file writes: a reader never sees a half-written file, a crash never leaves one behind."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; on success it is renamed onto ``dest`` (file or directory).

    The temporary lives in the same directory so ``os.replace`` is an atomic rename on the same filesystem.
    On error the temporary is removed and ``dest`` is untouched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)) / f"out{suffix}"
    try:
        yield tmp
        if dest.is_dir() and tmp.is_dir():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def atomic_write_text(dest: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``dest`` atomically (fsync before the rename)."""
    with atomic_path(dest) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return Path(dest)


def atomic_write_json(dest: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically."""
    return atomic_write_text(dest, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def save_resolved_config(cfg: Any, output_dir: str | Path, name: str = "config.yaml") -> Path | None:
    """Write the fully resolved config next to the outputs (rank 0 only, atomically)."""
    from fastdecode.distributed import is_main_process

    if not is_main_process():
        return None
    from omegaconf import OmegaConf

    path = Path(output_dir) / name
    atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))
    log.info("resolved config saved to %s", path)
    return path
