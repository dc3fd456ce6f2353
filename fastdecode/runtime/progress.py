"""Progress of a long phase, shown one way everywhere: ``phase``.

A phase says what it does when it starts and how long it took when it ends (two INFO log lines). In between
it shows a tqdm bar on a terminal, else a log line at most every ``LOG_EVERY`` seconds with the count and the
time left. How it behaves in tests: docs/design/runtime.md.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

LOG_EVERY = 30.0  # seconds between two progress lines in the log (no terminal)


def human_seconds(seconds: float) -> str:
    """``"42 s"``, ``"3.8 min"``, ``"1.2 h"``."""
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """The counter of a running ``phase``: ``update(n)`` after each item (a no-op count when the phase has
    no total)."""

    def __init__(self, name: str, total: int | None, unit: str, logger: logging.Logger) -> None:
        self.name, self.total, self.unit, self.log = name, total, unit, logger
        self.done = 0
        self.start = self._last = time.perf_counter()
        self._bar = None
        if total and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=name, unit=unit, mininterval=1.0, leave=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if self.total and now - self._last >= LOG_EVERY and self.done < self.total:
            self._last, elapsed = now, now - self.start
            left = elapsed / self.done * (self.total - self.done)
            self.log.info(
                "%s: %d/%d %ss, %s so far, about %s left",
                self.name,
                self.done,
                self.total,
                self.unit,
                human_seconds(elapsed),
                human_seconds(left),
            )

    def close(self) -> float:
        """Remove the bar; returns the seconds since the phase started."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        return time.perf_counter() - self.start


@contextmanager
def phase(
    name: str,
    detail: str | None = None,
    *,
    total: int | None = None,
    unit: str = "item",
    logger: logging.Logger | None = None,
) -> Iterator[Progress]:
    """Log ``"<name>: <detail>"`` now and ``"<name>: done in <duration>"`` at the end; with ``total``,
    the yielded ``Progress`` shows how far the phase is (see the module docstring). Also a decorator:
    ``@phase("cost model")`` logs every call of the function it decorates."""
    logger = logger or log
    logger.info("%s: %s", name, detail or "started")
    progress = Progress(name, total, unit, logger)
    try:
        yield progress
    finally:
        seconds = progress.close()
    logger.info("%s: done in %s", name, human_seconds(seconds))
