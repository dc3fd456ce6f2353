"""``fastdecode.runtime.progress.phase``: a start and an end line in the log, and without a terminal, rate-limited
lines saying how far a phase is."""

from __future__ import annotations

import logging

import pytest

import fastdecode.runtime.progress
from fastdecode.runtime.progress import human_seconds, phase


def test_a_phase_logs_its_start_its_progress_and_its_duration(caplog, monkeypatch):
    monkeypatch.setattr(
        fastdecode.runtime.progress, "LOG_EVERY", 0.0
    )  # every update may log (no terminal here)
    with caplog.at_level(logging.INFO, logger="fastdecode.runtime.progress"):
        with phase("scoring", "3 examples", total=3, unit="example") as progress:
            for _ in range(3):
                progress.update()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "scoring: 3 examples" and lines[-1].startswith("scoring: done in ")
    assert lines[1].startswith("scoring: 1/3 examples, ") and "left" in lines[1]
    assert len(lines) == 4  # the last update is the end line's


def test_without_a_terminal_progress_lines_are_rate_limited(caplog):
    with caplog.at_level(logging.INFO, logger="fastdecode.runtime.progress"):
        with phase("scoring", total=100) as progress:
            for _ in range(100):
                progress.update()
    assert [r.getMessage() for r in caplog.records][0] == "scoring: started" and len(caplog.records) == 2


def test_a_failed_phase_logs_no_end_line(caplog):
    with caplog.at_level(logging.INFO, logger="fastdecode.runtime.progress"), pytest.raises(RuntimeError):
        with phase("scoring"):
            raise RuntimeError("boom")
    assert [r.getMessage() for r in caplog.records] == ["scoring: started"]


def test_durations_read_in_the_unit_that_fits():
    assert [human_seconds(s) for s in (4.23, 42.4, 228, 7200)] == ["4.2 s", "42 s", "3.8 min", "2.0 h"]
