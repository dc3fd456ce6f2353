"""Atomic file and directory writes: a reader never sees a half-written file, a crash never leaves one behind.

What they leave has the permissions the umask gives (``tempfile.mkdtemp`` makes 0700 directories and some
writers, safetensors among them, 0600 files: a shared cache or an exported model must stay readable). A write
that runs out of space raises ``fastdecode.errors.DiskFullError`` naming the destination, which keeps its
previous version. Before the work: ``check_writable`` (a probe file) and ``check_free_space`` (an estimate
against ``shutil.disk_usage``) raise the named errors of ``fastdecode.errors``.
"""

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

from fastdecode.errors import (
    DiskSpaceError,
    OutputNotWritableError,
    disk_full_errors,
    free_bytes,
    human_bytes,
)

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """The fastdecode cache: ``$FASTDECODE_CACHE`` if set, else ``~/.cache/fastdecode``."""
    env = os.environ.get("FASTDECODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fastdecode"


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
        with disk_full_errors(dest):  # out of space: DiskFullError naming dest; the staging is removed below
            yield tmp
            apply_umask(tmp)
            if dest.is_dir() and tmp.is_dir():
                _swap_directory(tmp, dest)
            else:
                os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it is to set it; restored at once
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give ``path`` (and everything under it) the umask's permissions: 0666 files, 0777 directories.

    Why: temporary directories are created 0700 and some writers create 0600 files; once renamed into place
    they would be unreadable for the other users of a shared cache or output folder.
    """
    mask, path = _umask(), Path(path)
    if not path.exists():
        return
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def _swap_directory(new: Path, dest: Path) -> None:
    """Put directory ``new`` in place of the existing ``dest``: two renames, then the old one is deleted.

    A crash between the renames leaves no ``dest`` (the old one sits beside it as ``.<name>.old-*``), never a
    mixture of the two; the next writer redoes its work.
    """
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent)) / "old"
    os.replace(dest, old)
    os.replace(new, dest)
    shutil.rmtree(old.parent, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory`` to disk, so the rename never publishes data still in the cache."""
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_directory(
    dest: str | os.PathLike, manifest: bool = True, main_process: bool = True, fault: str | None = None
) -> Iterator[Path]:
    """Yield an empty staging directory; on success it is completed and renamed onto ``dest`` as a whole.

    Completed means: umask permissions, every file fsynced, and (``manifest``) the file manifest
    (``fastdecode.files.checkpoint.MANIFEST``: every file and its size) written last. So ``dest`` either holds the
    previous version or the whole new one. Staging directories left by a killed earlier writer of ``dest``
    are removed first: one writer per destination (an export: one run per output_dir; a conversion: under
    its lock). ``main_process=False`` (other ranks of a multi-process job) yields a path nobody writes to and
    does nothing. ``fault`` names the test hook (``fastdecode.files.faults``) fired just before the rename.
    """
    dest = Path(dest)
    if not main_process:
        yield dest.parent / f".{dest.name}.rank-unused"
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*dest.parent.glob(f".{dest.name}.*.tmp"), *dest.parent.glob(f".{dest.name}.old-*")]:
        log.info("removing %s, left by an earlier write of %s that did not finish", stale, dest)
        shutil.rmtree(stale, ignore_errors=True)
    with atomic_path(dest) as tmp:
        tmp.mkdir()
        yield tmp
        _fsync_tree(tmp)
        if manifest:
            from fastdecode.files.checkpoint import write_manifest

            write_manifest(tmp)
        if fault:
            from fastdecode.files.faults import fault_point

            fault_point(fault)  # tests: a kill here leaves the whole directory staged, nothing in place


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
    from fastdecode.files.distributed import is_main_process

    if not is_main_process():
        return None
    from omegaconf import OmegaConf

    path = Path(output_dir) / name
    atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))
    log.info("resolved config saved to %s", path)
    return path


def _nearest_existing(directory: Path) -> Path:
    here = directory.absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    return here


def check_writable(directory: str | os.PathLike, option: str = "output_dir") -> None:
    """Raise ``OutputNotWritableError`` unless a file can be created in ``directory`` (or, when it does not
    exist yet, in its nearest existing parent, where it would be created): a probe file is created and
    deleted. ``option`` is the setting that names another directory. Fault point ``writable``."""
    from fastdecode.files.faults import fault_point

    target = Path(directory)
    where = _nearest_existing(target)
    try:
        if not where.is_dir():
            raise NotADirectoryError(f"{where} is not a directory")
        with tempfile.NamedTemporaryFile(prefix=".fastdecode-probe-", dir=where):
            fault_point("writable")
    except OSError as err:
        inside = "" if where == target.absolute() else f" (it would be created in {where})"
        reason = err.strerror or str(err)
        raise OutputNotWritableError(
            f"{option}={directory} is not writable{inside}: {reason}. Choose a writable directory with "
            f"{option}=PATH."
        ) from None


def check_free_space(directory: str | os.PathLike, needed: int, what: str, lower: str) -> None:
    """Raise ``DiskSpaceError`` when ``needed`` bytes (``what``: the estimate, said in the message) exceed the
    free space of ``directory``'s disk; ``lower``: the options that lower the need. Unknown free space
    (no ``statvfs``) passes."""
    free = free_bytes(directory)
    if free is None or needed <= free:
        log.info(
            "disk: %s needs about %s, %s free in %s",
            what,
            human_bytes(needed),
            human_bytes(free or 0),
            directory,
        )
        return
    raise DiskSpaceError(
        f"not enough disk space in {directory}: {what} needs about {human_bytes(needed)} ({needed} bytes), "
        f"{human_bytes(free)} ({free} bytes) are free. Free space, choose another output directory, or "
        f"lower {lower}."
    )
