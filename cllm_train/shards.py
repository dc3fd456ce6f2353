"""Crash-safe sharded JSONL output of a collection: what is in the manifest is never lost or duplicated.

Each rank appends to its own shards (``shard-r<rank>-<k>.jsonl``) and owns a part manifest
(``manifest.json`` itself with one process, ``manifest.rank<r>.json`` with several; rank 0 merges the parts
into ``manifest.json`` at the end). A batch of prompts is committed in two steps: its records are appended
and fsynced, then the part manifest (shard byte lengths and record counts, completed prompt ids, filter
counts) is replaced atomically. A kill between the two leaves bytes past the recorded length: a restart
truncates every shard to its recorded length, so a prompt is either committed with all its blocks or redone.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from cllm_train.records import MANIFEST, SCHEMA_VERSION
from fastdecode.config import ConfigError
from fastdecode.errors import disk_full_error, is_disk_full
from fastdecode.files.faults import fault_point
from fastdecode.files.io import atomic_write_json

# Config keys that change the records: a resume with different values would mix two collections.
RECORD_KEYS = ("block_size", "init", "max_new_seq_len", "max_prompt_len", "labels", "seed", "filters", "data")


def part_name(rank: int, world_size: int) -> str:
    return MANIFEST if world_size == 1 else f"manifest.rank{rank}.json"


class ShardWriter:
    """One rank's shards and part manifest in ``directory``; resumes from an existing part manifest.

    Args:
        header: model, tokenizer, seed, config (the manifest fields that must match on resume).
        shard_records: start a new shard once the current one holds this many records.
    """

    def __init__(
        self, directory: str | Path, rank: int, world_size: int, header: dict, shard_records: int
    ) -> None:
        self.dir, self.rank, self.shard_records = Path(directory), rank, shard_records
        self.path = self.dir / part_name(rank, world_size)
        self.dir.mkdir(parents=True, exist_ok=True)
        fresh = header | {"schema_version": SCHEMA_VERSION, "world_size": world_size, "complete": False}
        fresh |= {
            "shards": [],
            "completed_prompt_ids": [],
            "filters": {},
            "skipped": {},
            "totals": _zero_totals(),
        }
        self.manifest = fresh
        if self.path.is_file():
            self.manifest = json.loads(self.path.read_text())
            check_resumable(self.manifest, fresh, self.path)
            self.manifest |= header | {"complete": False}  # e.g. a larger max_prompts extends the collection
            self._truncate()
        self.completed = set(self.manifest["completed_prompt_ids"])

    def _truncate(self) -> None:
        """Cut every shard back to the length its manifest committed (drops an interrupted batch)."""
        for shard in self.manifest["shards"]:
            path = self.dir / shard["path"]
            if not path.is_file() or path.stat().st_size < shard["bytes"]:
                raise ConfigError(
                    f"{path} is missing or shorter than the {shard['bytes']} bytes {self.path.name} records: "
                    "the output directory was damaged; collect into a fresh output_dir."
                )
            os.truncate(path, shard["bytes"])

    def _shard(self) -> dict:
        shards = self.manifest["shards"]
        if not shards or shards[-1]["records"] >= self.shard_records:
            shards.append({"path": f"shard-r{self.rank}-{len(shards):05d}.jsonl", "records": 0, "bytes": 0})
            (self.dir / shards[-1]["path"]).write_bytes(b"")
        return shards[-1]

    def commit(
        self, ids: list[str], records: list[list[dict]], filtered: Counter, forwards: int, tokens: int
    ) -> None:
        """Append the records of the prompts ``ids`` (all their blocks), then record them as completed."""
        shard = self._shard()
        lines = [json.dumps(rec, separators=(",", ":")) + "\n" for recs in records for rec in recs]
        data = "".join(lines).encode()
        self._append(shard, data)
        shard["bytes"] += len(data)
        shard["records"] += len(lines)
        self.manifest["completed_prompt_ids"] += ids
        self.completed.update(ids)
        self.manifest["filters"] = dict(Counter(self.manifest["filters"]) + filtered)
        totals = self.manifest["totals"]
        totals["prompts"] += len(ids)
        totals["records"] += len(lines)
        totals["forwards"] += forwards
        totals["tokens"] += tokens
        atomic_write_json(self.path, self.manifest)

    def _append(self, shard: dict, data: bytes) -> None:
        """Write ``data`` after the committed bytes of ``shard`` and fsync (fault point ``trajectory@K``,
        K: the shard's number, after the write). Out of space: the shard is cut back to its committed length
        (what the manifest records stays, the space is freed) and ``DiskFullError`` names it."""
        path = self.dir / shard["path"]
        try:
            with open(path, "r+b") as f:
                f.seek(shard["bytes"])
                f.write(data)
                f.truncate()
                f.flush()
                fault_point("trajectory", len(self.manifest["shards"]) - 1)
                os.fsync(f.fileno())
        except OSError as err:
            if not is_disk_full(err):
                raise
            os.truncate(path, shard["bytes"])
            raise disk_full_error(path, lower="max_prompts or max_new_seq_len") from err

    def set_skipped(self, skipped: Counter) -> None:
        """Prompts of this rank refused before collection, per reason (recomputed identically on resume)."""
        self.manifest["skipped"] = dict(skipped)
        atomic_write_json(self.path, self.manifest)

    def finish(self) -> None:
        self.manifest["complete"] = True
        atomic_write_json(self.path, self.manifest)


def _zero_totals() -> dict:
    return {"prompts": 0, "records": 0, "forwards": 0, "tokens": 0}


def check_resumable(found: dict, wanted: dict, path: Path) -> None:
    """Refuse to extend a collection made with another model, tokenizer, world size or record settings."""
    keys = ("schema_version", "model.id", "tokenizer.vocab_hash", "world_size")  # not names or paths
    diffs = [key for key in keys if _get(found, key) != _get(wanted, key)]
    diffs += [f"config.{k}" for k in RECORD_KEYS if found["config"].get(k) != wanted["config"].get(k)]
    if diffs:
        detail = "; ".join(f"{k}: {_get(found, k)!r} there, {_get(wanted, k)!r} now" for k in diffs)
        raise ConfigError(
            f"{path} belongs to a collection with other settings ({detail}). Resume with the same settings "
            "(and the same number of processes), or collect into another output_dir."
        )


def _get(manifest: dict, dotted: str):
    for part in dotted.split("."):
        manifest = manifest.get(part) if isinstance(manifest, dict) else None
    return manifest


def merge_parts(directory: str | Path, world_size: int) -> dict:
    """Rank 0, after every rank finished: merge the part manifests into ``manifest.json``."""
    directory = Path(directory)
    if world_size == 1:
        return json.loads((directory / MANIFEST).read_text())
    parts = [json.loads((directory / part_name(r, world_size)).read_text()) for r in range(world_size)]
    merged = dict(parts[0])
    merged["shards"] = [s for p in parts for s in p["shards"]]
    merged["completed_prompt_ids"] = [i for p in parts for i in p["completed_prompt_ids"]]
    for key in ("filters", "skipped"):
        merged[key] = dict(sum((Counter(p.get(key, {})) for p in parts), Counter()))
    merged["totals"] = {k: sum(p["totals"][k] for p in parts) for k in parts[0]["totals"]}
    merged["complete"] = all(p["complete"] for p in parts)
    atomic_write_json(directory / MANIFEST, merged)
    return merged
