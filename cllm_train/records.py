"""Jacobi trajectory records: the schema written by ``collect_jacobi.py`` and read by CLLM training.

A trajectory directory holds sharded JSONL files (one line per block of one prompt, ``SCHEMA_VERSION`` 1,
fields ``FIELDS``) and one ``manifest.json``. ``read_manifest`` and ``check_manifest`` refuse trajectories of
another model or tokenizer; ``iter_records`` validates every record, and a malformed one raises a
``RecordError`` naming file and line. The schema and the manifest: docs/design/methods.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastdecode.config import ConfigError
from fastdecode.jacobi import first_mismatch
from fastdecode.runtime.identity import model_identity, tokenizer_fingerprint  # noqa: F401 (re-exported)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
FIELDS = (
    "prompt_id",
    "block",
    "prefix",
    "states",
    "first_mismatch",
    "fixed_point",
    "eos",
    "labels",
    "prompt_len",
)


class RecordError(ConfigError):
    """A trajectory file or record is malformed; the message names the file, the line and the problem."""


def _fail(where: str, problem: str) -> RecordError:
    return RecordError(
        f"{where}: malformed trajectory record: {problem}. Re-collect the directory with collect_jacobi.py "
        "(or delete the damaged shard and its entry in manifest.json, then resume)."
    )


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def validate_record(rec: Any, where: str = "record", vocab_size: int | None = None) -> dict:
    """Check ``rec`` against the schema (keys, types, lengths, internal consistency); return it.

    ``where`` names the record in errors (e.g. ``"shard-r0-00000.jsonl:17"``); ``vocab_size`` also checks ids.
    """
    if not isinstance(rec, dict):
        raise _fail(where, f"expected a JSON object, got {type(rec).__name__}")
    keys = set(rec)
    if keys != set(FIELDS):
        missing, extra = sorted(set(FIELDS) - keys), sorted(keys - set(FIELDS))
        raise _fail(where, f"missing keys {missing}, unexpected keys {extra}")
    if not isinstance(rec["prompt_id"], str):
        raise _fail(where, "prompt_id must be a string")
    for key in ("block", "prompt_len"):
        if not isinstance(rec[key], int) or isinstance(rec[key], bool) or rec[key] < 0:
            raise _fail(where, f"{key} must be a non-negative integer")
    if not isinstance(rec["eos"], bool):
        raise _fail(where, "eos must be true or false")
    for key in ("prefix", "fixed_point", "first_mismatch"):
        if not _int_list(rec[key]):
            raise _fail(where, f"{key} must be a list of integers")
    if rec["labels"] is not None and not _int_list(rec["labels"]):
        raise _fail(where, "labels must be a list of integers or null")
    fixed, states = rec["fixed_point"], rec["states"]
    n = len(fixed)
    if n < 2:
        raise _fail(where, f"fixed_point has {n} tokens; blocks have n >= 2")
    if not isinstance(states, list) or not states or not all(_int_list(s) and len(s) == n for s in states):
        raise _fail(where, f"states must be a non-empty list of integer lists of length n={n}")
    if states[-1] != fixed:
        raise _fail(where, "the last state differs from fixed_point")
    if rec["first_mismatch"] != [first_mismatch(s, fixed) for s in states]:
        raise _fail(where, "first_mismatch does not match the states and the fixed point")
    if not 0 < rec["prompt_len"] <= len(rec["prefix"]):
        raise _fail(where, f"prompt_len={rec['prompt_len']} outside [1, len(prefix)={len(rec['prefix'])}]")
    if vocab_size is not None:
        ids = rec["prefix"] + fixed + [t for s in states for t in s]
        if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
            raise _fail(where, f"token ids outside the vocabulary [0, {vocab_size})")
    return rec


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a trajectory directory, with a clear error when it is missing or from another schema."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ConfigError(
            f"{path} not found: not a trajectory directory, or a multi-process collection that was "
            "interrupted before rank 0 merged the manifests. Run collect_jacobi.py with this output_dir "
            "(it resumes) to finish it."
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RecordError(f"{path}: not valid JSON ({err}); re-run collect_jacobi.py to rewrite it.") from err
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ConfigError(
            f"{path}: schema_version={version}, this code reads {SCHEMA_VERSION}; re-collect the trajectories."
        )
    return manifest


def check_manifest(manifest: dict, tokenizer: Any, model_id: str) -> None:
    """Refuse trajectories collected with another model or tokenizer than the one about to be trained.

    ``model_id`` is ``model_identity(model_cfg)`` of the model being trained.
    """
    problems = []
    if manifest["model"]["id"] != model_id:
        problems.append(f"model '{manifest['model']['id']}' (training '{model_id}')")
    ours, theirs = tokenizer_fingerprint(tokenizer), manifest["tokenizer"]
    if ours["vocab_size"] != theirs["vocab_size"] or ours["vocab_hash"] != theirs["vocab_hash"]:
        problems.append(
            f"tokenizer '{theirs['name']}' ({theirs['vocab_size']} tokens, hash {theirs['vocab_hash'][:12]}) "
            f"(training with '{ours['name']}', {ours['vocab_size']} tokens, hash {ours['vocab_hash'][:12]})"
        )
    if problems:
        raise ConfigError(
            "the trajectories were collected with " + " and ".join(problems) + ": consistency training needs "
            "fixed points of the model being trained. Collect them with that model "
            "(python collect_jacobi.py model=...) or point the recipe at the matching trajectory directory."
        )


def iter_records(
    directory: str | Path, manifest: dict | None = None, vocab_size: int | None = None
) -> Iterator[dict]:
    """Every record of a trajectory directory, shard by shard in manifest order, validated.

    Only the first ``bytes`` bytes of each shard (what the manifest committed) are read.
    """
    directory = Path(directory)
    manifest = read_manifest(directory) if manifest is None else manifest
    for shard in manifest["shards"]:
        path = directory / shard["path"]
        if not path.is_file() or path.stat().st_size < shard["bytes"]:
            raise RecordError(
                f"{path}: missing or shorter than the {shard['bytes']} bytes recorded in {MANIFEST}; "
                "the directory was damaged: re-collect it."
            )
        with open(path, "rb") as f:
            data = f.read(shard["bytes"])
        count = 0
        for line_no, line in enumerate(data.splitlines(), 1):
            where = f"{path}:{line_no}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise _fail(where, f"not valid JSON ({err.msg})") from err
            count += 1
            yield validate_record(rec, where, vocab_size)
        if count != shard["records"]:
            raise RecordError(
                f"{path}: {count} records, {MANIFEST} says {shard['records']}; re-collect the directory."
            )
