"""Crash-safe sharded tensor records: what the manifest lists is never lost or duplicated (kill -9 safe).

``ShardWriter`` writes records (dicts of tensors) in order into safetensors shards and commits each shard by
an atomic rename, then an atomic rewrite of ``manifest.json``, the only truth; a restart deletes what the
manifest does not list and resumes. ``ShardReader`` reads the records back. A restart with another header is
refused (``ShardHeaderError``). The commit protocol: docs/design/files.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fastdecode.config import ConfigError
from fastdecode.errors import disk_full_error, is_disk_full
from fastdecode.files.faults import fault_point
from fastdecode.files.io import atomic_write_json

MANIFEST = "manifest.json"
FORMAT = "fastdecode-tensor-shards"
VERSION = 1
OFFSETS = ".offsets"


class ShardHeaderError(ConfigError):
    """A shard directory belongs to another model, tokenizer or settings than the ones asked for."""


def header_diff(found: dict, wanted: dict, keys: list[str] | None = None, prefix: str = "") -> list[str]:
    """Dotted keys (all of ``wanted``'s, or ``keys``) whose values differ between two headers."""
    diffs = []
    for key in keys if keys is not None else sorted(set(found) | set(wanted)):
        a, b = found.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += header_diff(a, b, None, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}")
    return diffs


def _get(header: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        header = header.get(part) if isinstance(header, dict) else None
    return header


def check_header(found: dict, wanted: dict, where: str | Path, keys: list[str] | None = None) -> None:
    """Raise ``ShardHeaderError`` naming every differing key (``keys``: only those top-level keys)."""
    diffs = header_diff(found, wanted, keys)
    if diffs:
        detail = "; ".join(f"{k}: {_get(found, k)!r} there, {_get(wanted, k)!r} now" for k in diffs[:6])
        raise ShardHeaderError(
            f"{where} was made with other settings ({detail}). Use the same model, tokenizer and settings, "
            "or another directory."
        )


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not supported on this platform: the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardWriter:
    """Append records to ``directory``; resumes after the records an existing manifest committed.

    Args:
        header: what the records depend on (model, tokenizer, settings); must equal the manifest's on resume.
        shard_records: records per shard (the commit unit: a kill loses at most the shard being built).
        lower: the options that make the records smaller, named when the disk is full (``DiskFullError``:
            the uncommitted shard is deleted, the manifest keeps the committed ones).
    """

    def __init__(self, directory: str | Path, header: dict, shard_records: int, lower: str = "") -> None:
        if shard_records < 1:
            raise ConfigError(f"shard_records={shard_records}: must be >= 1.")
        self.dir, self.shard_records, self.lower = Path(directory), shard_records, lower
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / MANIFEST
        self.manifest = {"format": FORMAT, "version": VERSION, "header": header, "shards": []}
        self.manifest |= {"records": 0, "complete": False, "stats": {}}
        if self.path.is_file():
            found = json.loads(self.path.read_text())
            check_header(found.get("header", {}), header, self.path)
            self.manifest = found
        self._clean()
        self.buffer: list[dict[str, torch.Tensor]] = []
        self._pending_stats: dict[str, float] = {}

    @property
    def records(self) -> int:
        """Records committed so far (where a resumed run starts)."""
        return self.manifest["records"]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def _clean(self) -> None:
        """Delete shards the manifest does not list and temporaries of an interrupted commit."""
        listed = {s["path"] for s in self.manifest["shards"]}
        for path in self.dir.iterdir():
            uncommitted = path.name.startswith("shard-") and path.name not in listed
            if uncommitted or path.name.startswith(".shard-"):
                path.unlink()
        for shard in self.manifest["shards"]:
            if not (self.dir / shard["path"]).is_file():
                raise ConfigError(
                    f"{self.dir / shard['path']} is listed in {self.path} but missing: the directory was "
                    "damaged; build it again in a fresh directory."
                )

    def reopen(self) -> None:
        """Extend a complete directory with more records (same header)."""
        self.manifest["complete"] = False
        atomic_write_json(self.path, self.manifest)

    def add(self, record: dict[str, torch.Tensor], stats: dict[str, float] | None = None) -> bool:
        """Buffer one record (and add ``stats`` to the manifest's running sums); commits a full shard.
        Returns True when this call committed a shard."""
        if self.complete:
            raise ConfigError(f"{self.path} is complete: no more records can be added.")
        self.buffer.append({k: v.detach().cpu().contiguous() for k, v in record.items()})
        self._pending_stats = _add_stats(self._pending_stats, stats or {})
        if len(self.buffer) >= self.shard_records:
            self.flush()
            return True
        return False

    def flush(self) -> None:
        """Commit the buffered records as one shard (nothing to do when the buffer is empty)."""
        if not self.buffer:
            return
        fields = list(self.buffer[0])
        tensors = {}
        for key in fields:
            parts = [rec[key] for rec in self.buffer]
            tensors[key] = torch.cat(parts, 0).contiguous()
            sizes = torch.tensor([0] + [p.shape[0] for p in parts], dtype=torch.long)
            tensors[key + OFFSETS] = sizes.cumsum(0)
        name = f"shard-{len(self.manifest['shards']):05d}.safetensors"
        manifest = dict(self.manifest, shards=[*self.manifest["shards"], {}])
        manifest["shards"][-1] = {"path": name, "records": len(self.buffer), "fields": fields}
        manifest["records"] = self.manifest["records"] + len(self.buffer)
        manifest["stats"] = _add_stats(self.manifest["stats"], self._pending_stats)
        try:
            self._commit(name, tensors, manifest)
        except Exception as err:  # the shard is not committed: nothing of it stays (it holds space)
            for path in (self.dir / f".{name}.tmp", self.dir / name):
                path.unlink(missing_ok=True)
            if is_disk_full(err):
                raise disk_full_error(self.dir / name, lower=self.lower) from err
            raise
        self.manifest = manifest
        self.buffer, self._pending_stats = [], {}

    def _commit(self, name: str, tensors: dict[str, torch.Tensor], manifest: dict) -> None:
        """Write shard ``name`` (temporary file, fsync, rename), then the manifest: the commit point.
        Fault point ``shard@K`` (K: the shard's number) between the write and the rename."""
        from safetensors.torch import save_file

        tmp = self.dir / f".{name}.tmp"
        save_file(tensors, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        fault_point("shard", len(manifest["shards"]) - 1)
        os.replace(tmp, self.dir / name)
        _fsync_dir(self.dir)
        atomic_write_json(self.path, manifest)

    def finish(self, **extra: Any) -> dict:
        """Commit what is buffered and mark the directory complete (``extra`` goes into the manifest)."""
        self.flush()
        self.manifest |= extra | {"complete": True}
        atomic_write_json(self.path, self.manifest)
        return self.manifest


def _add_stats(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)}


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; build the shard directory first.")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a {FORMAT} manifest (format={manifest.get('format')!r}).")
    return manifest


class ShardReader:
    """Random access to the committed records of a shard directory (lazy, memory-mapped reads); ``limit``:
    only the first records."""

    def __init__(self, directory: str | Path, limit: int | None = None) -> None:
        self.dir = Path(directory)
        self.manifest = read_manifest(self.dir)
        self.starts = [0]
        for shard in self.manifest["shards"]:
            self.starts.append(self.starts[-1] + shard["records"])
        self.size = self.starts[-1] if limit is None else min(limit, self.starts[-1])
        self._open: dict[int, tuple[Any, dict[str, torch.Tensor]]] = {}

    @property
    def header(self) -> dict:
        return self.manifest["header"]

    def __len__(self) -> int:
        return self.size

    def _shard(self, index: int):
        if index not in self._open:
            from safetensors import safe_open

            handle = safe_open(str(self.dir / self.manifest["shards"][index]["path"]), framework="pt")
            offsets = {k[: -len(OFFSETS)]: handle.get_tensor(k) for k in handle.keys() if k.endswith(OFFSETS)}
            self._open[index] = (handle, offsets)
        return self._open[index]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.read(i)

    def read(self, i: int, fields: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Record ``i`` (only ``fields``, when given: the others are not read from disk)."""
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} of {len(self)}")
        import bisect

        shard = bisect.bisect_right(self.starts, i) - 1
        local = i - self.starts[shard]
        handle, offsets = self._shard(shard)
        out = {}
        for key, off in offsets.items():
            if fields is not None and key not in fields:
                continue
            a, b = int(off[local]), int(off[local + 1])
            out[key] = handle.get_slice(key)[a:b]
        return out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self)):
            yield self[i]
