"""Inter-process locks that say who holds them: the holder's pid, host and start time are in the lock file.

``fcntl.flock`` does the locking, so a lock dies with its process (a kill -9 never leaves a lock that blocks
forever); the holder record only explains. A waiter logs whom it waits for; a process that finds the record of
a holder that no longer holds the lock (it was killed) logs that it takes over.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from fastdecode.errors import UserError

log = logging.getLogger(__name__)


class LockHeld(UserError, RuntimeError):
    """Another process holds a lock that this one may not wait for; the message names it."""


def _read_holder(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        holder = json.loads(raw) if raw.strip() else None
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _write_holder(fd: int) -> None:
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(me).encode())


def describe(holder: dict | None) -> str:
    """``pid 123 on host h (since ...)``, or ``an unknown process`` when the lock file says nothing."""
    if not holder:
        return "an unknown process (the lock file names no holder)"
    return f"pid {holder.get('pid')} on host {holder.get('host')} (since {holder.get('since')})"


def _fate(holder: dict) -> str:
    """Why a recorded holder no longer holds its lock, as far as this host can tell."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return "it no longer holds the lock"
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return "that process is not running: killed or crashed"
    except PermissionError:
        pass
    return "that pid is alive but no longer holds the lock"


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, what: str, wait: bool = True) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for the ``with`` block; ``what`` names the guarded thing in logs.

    Held by another process: ``wait=True`` logs the holder and waits; ``wait=False`` raises
    :class:`LockHeld` naming the holder and the lock file.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no locking at all (as before)
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            if not wait:
                raise LockHeld(
                    f"{what} is in use by {describe(holder)} (lock file {path}). Wait for that process to "
                    "finish, or stop it; a killed process releases the lock by itself."
                ) from None
            log.warning("waiting for %s: it is locked by %s (lock file %s)", what, describe(holder), path)
            start = time.perf_counter()
            fcntl.flock(fd, fcntl.LOCK_EX)
            log.info("got the lock on %s after %.1fs", what, time.perf_counter() - start)
        else:
            holder = _read_holder(fd)
            if holder and holder.get("pid") != os.getpid():
                log.warning(
                    "taking over the stale lock on %s: %s left it without releasing it (%s)",
                    what,
                    describe(holder),
                    _fate(holder),
                )
        _write_holder(fd)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # released cleanly: the next holder finds no record to take over
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
