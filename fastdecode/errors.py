"""The one home of user-facing errors: what a command-line user sees as one line, ``error: <message>``.

``UserError`` is the base of every error whose message says what is wrong and how to fix it. The entry points
print it as one line and exit with code 2 (``fastdecode_cli.launch.one_line_errors``); any other exception is
a bug and keeps its traceback. The disk errors live here too: ``OutputNotWritableError``, ``DiskSpaceError``
and ``DiskFullError``. Details: docs/design/core.md.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator


class UserError(Exception):
    """An error the user can fix; the message says what is wrong and how to fix it (entry points print it
    as ``error: <message>`` and exit 2, without a traceback)."""


class OutputNotWritableError(UserError):
    """An output directory (or the folder it would be created in) cannot be written."""


class DiskSpaceError(UserError):
    """What a run will write is more than the free space of its output directory's disk."""


class DiskFullError(UserError):
    """A write failed because the disk is full; ``path`` is what was being written."""

    def __init__(self, message: str, path: str | os.PathLike | None = None) -> None:
        super().__init__(message)
        self.path = path


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'`` (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# How a full disk reads: OSError ENOSPC (and EDQUOT: a quota), safetensors' SafetensorError with the OS
# message, and torch.save's zip writer, which reports a short write as "unexpected pos".
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "unexpected pos")


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) says the disk is full."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, DiskFullError):
            return True
        if isinstance(err, OSError) and err.errno in _FULL_ERRNOS:
            return True
        if type(err).__name__ in ("SafetensorError", "RuntimeError") and any(
            t in str(err) for t in _FULL_TEXTS
        ):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the disk of ``path`` (or of its nearest existing parent); None when unknown."""
    import shutil
    from pathlib import Path

    here = Path(path).absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        return shutil.disk_usage(here).free
    except OSError:
        return None


def disk_full_error(path: str | os.PathLike, lower: str = "", note: str = "") -> DiskFullError:
    """The error for a write into ``path`` that ran out of space; ``lower``: what else lowers the need (e.g.
    ``"trainer.save_total_limit"``), ``note``: what was done about it (e.g. an incomplete file deleted)."""
    free = free_bytes(path)
    room = f", {human_bytes(free)} free now" if free is not None else ""
    also = f", or lower {lower}," if lower else ""
    return DiskFullError(
        f"the disk is full: writing {path} failed (no space left on device{room}){note}. Free space on that "
        f"disk{also} and run again: what was complete is kept, and the rerun resumes from it.",
        path,
    )


@contextlib.contextmanager
def disk_full_errors(path: str | os.PathLike, lower: str = "") -> Iterator[None]:
    """Inside: any way of saying "the disk is full" becomes ``DiskFullError`` naming ``path`` (``lower``: see
    ``disk_full_error``). A ``DiskFullError`` raised further in (it names the file) passes through unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        if is_disk_full(err):
            raise disk_full_error(path, lower) from err
        raise
