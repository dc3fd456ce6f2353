"""The model's own answers a feature cache generated (``source=generate``), reused: as ``answers.jsonl``
beside the cache (``{"prompt", "response", "response_ids"}`` records, what ``fastdecode-suffix-index`` and
``data=jsonl`` read) and as a suffix decoding corpus (``save_corpus``: the answers' token ids exactly, the
prompts' twin keys in its header), so no second generation is needed. Design notes: docs/design/training.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastdecode.config import ConfigError
from fastdecode.data.twins import prompt_digests
from fastdecode.files.io import atomic_write_text
from fastdecode.files.tensor_shards import ShardReader
from fastdecode.registry import save_corpus as save_index_file

ANSWERS_FILE = "answers.jsonl"  # beside the feature cache's manifest
CORPUS_DEPTH = 64  # the suffix index's depth (fastdecode-suffix-index's default max_depth)


def generated_answers(reader: ShardReader, prompts: Sequence[dict], tokenizer: Any) -> list[dict]:
    """Per cached record, in cache order: its prompt's text (``prompts[index]["prompt"]``: the examples the
    cache generated from), the answer as text and its token ids exactly as generated (EOS kept where the
    model ended with it)."""
    answers = []
    for i in range(len(reader)):
        record = reader.read(i, ["index", "targets"])
        ids = [int(t) for t in record["targets"].tolist()]
        prompt = prompts[int(record["index"][0])].get("prompt")
        text = tokenizer.decode(ids, skip_special_tokens=True)
        answers.append({"prompt": prompt, "response": text, "response_ids": ids})
    return answers


def write_answers(directory: str | Path, answers: list[dict]) -> Path:
    """``answers`` as ``<directory>/answers.jsonl`` (atomic), one JSON object a line."""
    path = Path(directory) / ANSWERS_FILE
    atomic_write_text(path, "".join(json.dumps(a) + "\n" for a in answers))
    return path


def save_corpus(
    path: str | Path,
    sequences: Sequence[Sequence[int]],
    prompts: Sequence[str | None],
    *,
    fingerprint: Any,
    max_depth: int = CORPUS_DEPTH,
) -> dict:
    """A suffix index file of ``sequences`` (token ids, one sequence each, in order; empty ones skipped) whose
    header records the twin-key digests of ``prompts`` (``fastdecode.data.twins.prompt_digests``: what an
    evaluation excludes). ``fingerprint``: the tokenizer's (``registry.corpus_fingerprint``). Refused when
    no sequence holds a token. Returns what was written."""
    if not any(sequences):
        raise ConfigError(
            f"a corpus of {len(sequences)} answers without a token drafts nothing: nothing was written to {path}."
        )
    keys = prompt_digests(prompts)
    built = save_index_file(
        path, [list(ids) for ids in sequences], fingerprint=fingerprint, prompt_keys=keys, max_depth=max_depth
    )
    return {"path": str(path), **built, "prompt_keys": len(keys)}
