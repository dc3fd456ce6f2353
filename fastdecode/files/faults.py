"""Fault injection for the reliability tests: kill this process at a named point, like a preempted node, or
make the write there fail as on a full or read-only disk.

``FASTDECODE_FAULT=NAME`` or ``NAME@N`` makes :func:`fault_point` (``NAME``, at ``N``) send SIGKILL to its own
process: no ``finally`` blocks, no flushing, exactly what the OOM killer or a lost node does. With a kind in
front, ``KIND:NAME[@N]``, the point raises instead (kill-free fault tests): ``enospc:`` an
``OSError(ENOSPC)`` ("No space left on device"), ``erofs:`` an ``OSError(EROFS)`` ("Read-only file system").
The points:

- ``step@N``: a training step N has ended, before anything of step N is saved (between checkpoints);
- ``checkpoint@N``: the Trainer is writing ``checkpoint-N``: its weights are written, its optimizer, scheduler,
  RNG and trainer state are not;
- ``export``: the final export is complete in its staging directory and not yet renamed onto ``final/``;
- ``shard@K``: tensor shard K (``fastdecode.files.tensor_shards``: feature caches) is written, not yet committed;
- ``trajectory@K``: a batch of trajectories is appended to shard K (``cllm_train/shards.py``), not committed;
- ``writable``: the probe file of an output directory's writability check (``fastdecode.files.io.check_writable``).

Unset (always, outside tests), a fault point costs one environment lookup.
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
