"""Fault injection for the reliability tests: kill this process at a named point, like a preempted node, or
make the write there fail as on a full or read-only disk.

``FASTDECODE_FAULT=NAME[@N]`` makes :func:`fault_point` send SIGKILL to its own process at that point;
``KIND:NAME[@N]`` (``enospc:``, ``erofs:``) raises the matching ``OSError`` instead. Unset (always, outside
tests), a fault point costs one environment lookup. The points and where they sit: docs/design/files.md.
"""

from __future__ import annotations

import errno
import logging
import os
import signal

ENV = "FASTDECODE_FAULT"

log = logging.getLogger(__name__)


KINDS = {"enospc": errno.ENOSPC, "erofs": errno.EROFS}  # KIND: -> the OSError the point raises


def _wanted() -> tuple[str | None, str]:
    """``(kind, point)`` of ``$FASTDECODE_FAULT``: kind None means a kill."""
    wanted = os.environ.get(ENV, "")
    kind, sep, point = wanted.partition(":")
    return (kind, point) if sep and kind in KINDS else (None, wanted)


def fault_armed(name: str, at: int | None = None) -> bool:
    """Whether ``$FASTDECODE_FAULT`` names this point (``[KIND:]NAME``, or ``[KIND:]NAME@AT``)."""
    point = _wanted()[1]
    return bool(point) and point in (name, f"{name}@{at}")


def fault_point(name: str, at: int | None = None) -> None:
    """When ``$FASTDECODE_FAULT`` names this point: SIGKILL this process, or raise the OSError of its kind;
    otherwise do nothing."""
    if fault_armed(name, at):
        kind = _wanted()[0]
        if kind is not None:
            code = KINDS[kind]
            log.warning(
                "%s=%s: raising %s here (fault injection)", ENV, os.environ[ENV], errno.errorcode[code]
            )
            raise OSError(code, os.strerror(code), f"{ENV}={os.environ[ENV]}")
        log.warning("%s=%s: killing process %d here (fault injection)", ENV, os.environ[ENV], os.getpid())
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
