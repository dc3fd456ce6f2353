"""What an exit adapter's training recorded (``adapters.json`` beside it), read without loading the adapter:
the acceptance ``auto`` plans it with."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fastdecode.drafters.exits.adapter import INDEX_FILE, AdapterError, read_meta, resolve_adapter
from fastdecode.files.io import atomic_write_json


@dataclass
class RecordedAdapter:
    """An exit adapter and what its training recorded (``adapters.json`` beside it): its directory, E, greedy
    agreement on the model's own generations (None when not recorded) and tokens per round of K drafts
    (``fastdecode.plan.acceptance.replay_rounds``; empty when not recorded)."""

    path: str
    exit_layer: int
    agreement: float | None
    tokens_per_round: dict[int, float] = field(default_factory=dict)


def write_adapter_record(directory: str | os.PathLike, report: dict) -> Path:
    """Record what ``fastdecode.reports.exits.adapter_generation_report`` measured (``report``: agreement raw
    and through each adapter, tokens per round) in ``adapters.json`` of ``directory`` (a training run's
    ``final/``, whose other fields are kept), atomically: what ``recorded_adapter`` and ``auto`` read."""
    path = Path(directory) / INDEX_FILE
    index = json.loads(path.read_text(encoding="utf-8"))
    index["agreement"] = {head: report[head] for head in ("raw", "adapter")}
    index["tokens_per_round"] = report["tokens_per_round"]
    return atomic_write_json(path, index)


def recorded_adapter(path: str | os.PathLike) -> RecordedAdapter:
    """An exit adapter's record without loading it: ``adapter.json`` (E) and what its training run measured
    (``adapters.json`` beside it, when there is one; a damaged one is refused by name)."""
    directory = resolve_adapter(path)
    meta = read_meta(directory)
    index, exit_key = directory.parent / INDEX_FILE, str(meta["exit_layer"])
    agreement, rounds = None, {}
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            agreement = ((data.get("agreement") or {}).get("adapter") or {}).get(exit_key)
            found = ((data.get("tokens_per_round") or {}).get("adapter") or {}).get(exit_key) or {}
            agreement = None if agreement is None else float(agreement)
            rounds = {int(k): float(v) for k, v in found.items()}
        except (ValueError, TypeError, AttributeError) as err:
            raise AdapterError(
                f"{index} is damaged ({err}); delete it (the adapter then has no recorded acceptance and auto "
                "does not plan it) or train the adapters again."
            ) from err
    return RecordedAdapter(str(directory), int(meta["exit_layer"]), agreement, rounds)
