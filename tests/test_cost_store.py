"""The store of measured costs (fastdecode/plan/cost_store.py): a damaged file or entry is measured again and
rewritten with a warning naming the file, writers at once keep each other's entries, and
``FASTDECODE_COSTS=refresh`` measures again what a process uses."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch

import fastdecode.plan.cost as cost
import fastdecode.plan.cost_store as cost_store
from fastdecode.plan.cost import decoding_costs
from fastdecode.plan.cost_store import load_measured, save_measured, store_file
from fastdecode.runtime.model import EarlyExitModel
from tests.helpers import lively_model


def quick_timer(name, fn, device):
    """A timer that runs nothing: ``measure_costs`` probes priced by their T."""
    return (1e-3 if name[0] == "layers" else 1e-4) * name[1]


@pytest.fixture
def measured(monkeypatch) -> list[int]:
    """The batch sizes ``measure_costs`` was called with (a timer that runs nothing: fast)."""
    calls: list[int] = []
    real = cost.measure_costs

    def counted(*args, **kwargs):
        calls.append(kwargs["batch"])
        return real(*args, timer=quick_timer, **kwargs)

    monkeypatch.setattr(cost, "measure_costs", counted)
    return calls


def drop(field):
    def damage(entry):
        del entry[field]

    return damage


def put(field, value):
    def damage(entry):
        entry[field] = value(entry[field]) if callable(value) else value

    return damage


# Damage to the whole file (its text) or to the one entry (a function of the entry's dict).
DAMAGED_FILES = {
    "not json": "{not json",
    "not an object": "[1, 2]",
    "another format": json.dumps({"format": 99, "entries": {}}),
    "entries not a table": json.dumps({"format": 1, "entries": [1]}),
}
DAMAGED_ENTRIES = {
    "not an object": None,
    "a missing field": drop("head"),
    "an unknown field": put("extra", 1),
    "a table of text": put("layer", "fast"),
    "a count as text": put("num_layers", "4"),
    "no step": put("step_seconds", None),
    "a negative step": put("step_seconds", -1.0),
    "a table one short": put("layer", lambda v: v[:-1]),
    "pads of another length": put("pad", []),
    "other probes": put("tokens", lambda v: [t + 1 for t in v]),
    "a number that is not": put("head", lambda v: [*v[:-1], "nan"]),
    "another batch": put("batch", 2),
}


@pytest.mark.parametrize("damage", [*DAMAGED_FILES, *(f"entry: {k}" for k in DAMAGED_ENTRIES)])
def test_a_damaged_store_is_measured_again_and_rewritten_with_a_warning(
    damage, tmp_path, monkeypatch, measured, caplog
):
    monkeypatch.setenv("FASTDECODE_COSTS", str(tmp_path))
    hf = lively_model("tiny-llama").hf
    first = decoding_costs(EarlyExitModel(hf))
    [stored] = list(tmp_path.rglob("*.json"))
    data = json.loads(stored.read_text())
    if damage in DAMAGED_FILES:
        stored.write_text(DAMAGED_FILES[damage])
    else:
        [key] = data["entries"]
        how = DAMAGED_ENTRIES[damage.removeprefix("entry: ")]
        if how is None:
            data["entries"][key] = "x"
        else:
            how(data["entries"][key])
        stored.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="fastdecode.plan.cost_store"):
        again = decoding_costs(EarlyExitModel(hf))  # a new process: no TypeError, measured again
    assert measured == [1, 1] and again == first
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(stored) in warnings[0], warnings
    assert decoding_costs(EarlyExitModel(hf)) == first and measured == [1, 1]  # rewritten whole
    entries = json.loads(stored.read_text())["entries"]
    assert list(entries.values()) == [json.loads(json.dumps(first.to_json()))]


def test_writers_at_once_keep_each_others_entries(tmp_path, monkeypatch):
    """Two writers of one file, interleaved where it hurts: the second reads the file while the first has read
    it and not yet written. The lock beside the file makes the second wait, and both entries are kept."""
    monkeypatch.setenv("FASTDECODE_COSTS", str(tmp_path))
    cpu, fingerprint = torch.device("cpu"), "f" * 64
    real = cost_store.atomic_write_json
    first_writing, second_done = threading.Event(), threading.Event()

    def write(path, obj):
        if threading.current_thread().name == "first":
            first_writing.set()
            second_done.wait(timeout=1.0)  # without the lock the second writes meanwhile (then this one
            # writes what it read, dropping the second's entry); with it the second waits for this write
            return real(path, obj)
        found = real(path, obj)
        second_done.set()
        return found

    monkeypatch.setattr(cost_store, "atomic_write_json", write)
    first = threading.Thread(target=save_measured, args=(fingerprint, cpu, "a", {"v": 1}), name="first")
    second = threading.Thread(target=save_measured, args=(fingerprint, cpu, "b", {"v": 2}), name="second")
    first.start()
    assert first_writing.wait(timeout=10)
    second.start()
    first.join(timeout=10)
    second.join(timeout=10)
    path = store_file(fingerprint, cpu)
    assert json.loads(path.read_text())["entries"] == {"a": {"v": 1}, "b": {"v": 2}}
    assert load_measured(fingerprint, cpu, "a", dict) == {"v": 1}


def test_refresh_measures_again_once_per_process_and_overwrites(tmp_path, monkeypatch, measured):
    """``FASTDECODE_COSTS=refresh`` (the default place, ``$FASTDECODE_CACHE/costs``): an entry this process
    uses is measured again and overwritten, once; ``off`` still keeps nothing."""
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))
    monkeypatch.setenv("FASTDECODE_COSTS", str(tmp_path / "costs"))  # the same place, named
    hf = lively_model("tiny-llama").hf
    decoding_costs(EarlyExitModel(hf))
    [stored] = list((tmp_path / "costs").rglob("*.json"))
    data = json.loads(stored.read_text())
    [key] = data["entries"]
    data["entries"][key]["step_seconds"] = 123.0  # a stale measurement
    stored.write_text(json.dumps(data))
    assert decoding_costs(EarlyExitModel(hf)).step_seconds == 123.0 and measured == [1]
    monkeypatch.setenv("FASTDECODE_COSTS", "refresh")
    fresh = decoding_costs(EarlyExitModel(hf))
    assert measured == [1, 1] and fresh.step_seconds != 123.0
    assert json.loads(stored.read_text())["entries"][key]["step_seconds"] == fresh.step_seconds
    assert decoding_costs(EarlyExitModel(hf)) == fresh and measured == [1, 1]  # once per process
    monkeypatch.setenv("FASTDECODE_COSTS", "off")
    decoding_costs(EarlyExitModel(hf))
    assert measured == [1, 1, 1]
