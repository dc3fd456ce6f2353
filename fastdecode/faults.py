"""Fault injection for the reliability tests: kill this process at a named point, like a preempted node.

``FASTDECODE_FAULT=NAME`` or ``NAME@N`` makes :func:`fault_point` (``NAME``, at ``N``) send SIGKILL to its own
process: no ``finally`` blocks, no flushing, exactly what the OOM killer or a lost node does. The points:

- ``step@N``: a training step N has ended, before anything of step N is saved (between checkpoints);
- ``checkpoint@N``: the Trainer is writing ``checkpoint-N``: its weights are written, its optimizer, scheduler,
  RNG and trainer state are not;
- ``export``: the final export is complete in its staging directory and not yet renamed onto ``final/``.

Unset (always, outside tests), a fault point costs one environment lookup.
"""

from __future__ import annotations

import logging
import os
import signal

ENV = "FASTDECODE_FAULT"

log = logging.getLogger(__name__)


def fault_armed(name: str, at: int | None = None) -> bool:
    """Whether ``$FASTDECODE_FAULT`` names this point (``NAME``, or ``NAME@AT``)."""
    wanted = os.environ.get(ENV)
    return bool(wanted) and wanted in (name, f"{name}@{at}")


def fault_point(name: str, at: int | None = None) -> None:
    """SIGKILL this process when ``$FASTDECODE_FAULT`` names this point; otherwise do nothing."""
    if fault_armed(name, at):
        log.warning("%s=%s: killing process %d here (fault injection)", ENV, os.environ[ENV], os.getpid())
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
