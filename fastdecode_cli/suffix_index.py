"""``fastdecode-suffix-index``: build a corpus index for suffix decoding once, e.g.
``fastdecode-suffix-index model=smollm2-135m input=data/sharegpt-smollm2-135m.jsonl output=corpus.sfx``.

Reads a jsonl of ``{"prompt", "response"}`` or ``{"text"}`` records (``response_ids``: token ids used as
they are), tokenizes each text as decoding produces it, and writes the suffix index file with the tokenizer's
fingerprint and the prompts' twin keys. Only the tokenizer loads. Evaluation sets are refused. How texts are
tokenized, EOS and the refusals: docs/design/cli.md.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from fastdecode.config import CONFIG_DIR, ConfigError, ModelConfig, group_choices, load_group, to_dataclass
from fastdecode_cli.launch import check_command_line, one_line_errors

EVAL_FIELDS = ("question_id", "task_id")  # MT-bench's and HumanEval's record ids


@dataclasses.dataclass
class SuffixIndexJob:
    model: ModelConfig
    input: str | None = None
    output: str | None = None
    max_depth: int = 64
    append_eos: bool = False


def evaluation_names() -> set[str]:
    """The names of the evaluation-only data configs (their sources may be shared with training sets)."""
    from fastdecode.data.config import DataConfig

    names = set()
    for name in group_choices("data"):
        data = load_group("data", name, DataConfig)
        if data.eval_only:
            names.add(name)
    return names


def read_texts(path: Path) -> list[dict]:
    """Each record's ``text`` (its response, or text), ``prompt`` (None without one) and ``ids`` (its
    ``response_ids``, None without them), in file order; an evaluation set or a malformed line is refused."""
    stem = path.name.lower()
    found = sorted(n for n in evaluation_names() if n and n.lower() in stem)
    if found:
        raise ConfigError(
            f"input={str(path)!r} looks like an evaluation set ({', '.join(found)}): a corpus of a benchmark's "
            "answers drafts them back while it is measured. Build it from training prompts' answers "
            "(fastdecode-regenerate)."
        )
    texts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ConfigError(f"input={str(path)!r} line {number} is not JSON ({err}).") from err
        text = record.get("response", record.get("text")) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(
                f'input={str(path)!r} line {number}: need a "response" (with its "prompt") or a "text" string.'
            )
        if any(key in record for key in EVAL_FIELDS):
            raise ConfigError(
                f"input={str(path)!r} line {number} is an evaluation set's record (it has "
                f"{[k for k in EVAL_FIELDS if k in record]}): build the corpus from training answers."
            )
        texts.append({"text": text, "prompt": record.get("prompt"), "ids": given_ids(path, number, record)})
    if not any(t["text"] or t["ids"] for t in texts):  # refused before the tokenizer loads or a write
        refuse_empty(path, len(texts))
    return texts


def given_ids(path: Path, number: int, record: dict) -> list[int] | None:
    """A record's ``response_ids`` (the answer's token ids as generated: a feature cache's ``answers.jsonl``),
    None when it has none; anything but a list of non-negative ints is refused."""
    ids = record.get("response_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise ConfigError(
            f"input={str(path)!r} line {number}: response_ids must be a list of token ids (non-negative ints)."
        )
    return ids


def sequence_ids(tokenizer: Any, record: dict, eos: list[int]) -> list[int]:
    """The ids a record adds to the index: its ``response_ids`` as given (checked against the vocabulary), or
    its text tokenized alone; ``eos`` appended unless the sequence already ends with it."""
    ids = record["ids"]
    if ids is None:
        ids = tokenizer(record["text"], add_special_tokens=False).input_ids
    elif ids and max(ids) >= len(tokenizer):
        raise ConfigError(
            f"response_ids hold token id {max(ids)} but the model's tokenizer has {len(tokenizer)} tokens: "
            "the ids were made by another tokenizer; give the model that generated them (model=...)."
        )
    return ids + eos if eos and ids[-1:] != eos else list(ids)


def refuse_empty(path: Path, records: int, why: str = "") -> None:
    """An input whose responses give the index no token: a corpus that drafts nothing is a mistake."""
    raise ConfigError(
        f"input={str(path)!r} has no non-empty response ({records} records{why}): a corpus of no text drafts "
        "nothing; give the jsonl of the model's answers (fastdecode-regenerate). Nothing was written."
    )


def check_job(job: SuffixIndexJob) -> tuple[Path, Path]:
    if not job.input or not Path(job.input).is_file():
        raise ConfigError(
            f"input={job.input!r}: give a jsonl file of {{prompt, response}} or {{text}} records."
        )
    if not job.output:
        raise ConfigError("output=PATH: where the suffix index file is written.")
    if job.max_depth < 2:
        raise ConfigError(f"max_depth={job.max_depth}: need >= 2.")
    return Path(job.input), Path(job.output)


def run(cfg: Any) -> dict:
    """Build and write the index ``cfg`` describes; returns what was built."""
    from fastdecode.data.twins import prompt_digests
    from fastdecode.drafters.suffix.index import SuffixIndex
    from fastdecode.drafters.suffix.index_file import save_index
    from fastdecode.drafters.suffix.sources import corpus_fingerprint
    from fastdecode.files.assets import model_load_path
    from fastdecode.files.io import check_writable
    from fastdecode.runtime.loading import load_tokenizer

    job = to_dataclass(SuffixIndexJob, cfg, "")
    source, out = check_job(job)
    check_writable(out.parent if str(out.parent) else Path("."), option="output")
    texts = read_texts(source)  # refused before the tokenizer loads
    start = time.perf_counter()
    tokenizer = load_tokenizer(
        job.model, None if job.model.source == "random" else model_load_path(job.model)
    )
    eos = [tokenizer.eos_token_id] if job.append_eos and tokenizer.eos_token_id is not None else []
    index, spoken = SuffixIndex(job.max_depth), 0  # spoken: responses that give a token besides EOS
    for i, record in enumerate(texts):
        ids = sequence_ids(tokenizer, record, eos)
        spoken += any(t not in eos for t in ids)
        if ids:
            index.add(i, ids)
    if not spoken:
        refuse_empty(source, len(texts), ", none of them a token once tokenized")
    keys = prompt_digests(t["prompt"] for t in texts if isinstance(t["prompt"], str))
    save_index(out, index, fingerprint=corpus_fingerprint(tokenizer), prompt_keys=keys)
    state_tokens = sum(len(t) for t in index.tokens.values())
    return {
        "output": str(out),
        "sequences": len(index),
        "tokens": state_tokens,
        "nodes": len(index.state()["parent"]),
        "bytes": out.stat().st_size,
        "prompt_keys": len(keys),
        "seconds": round(time.perf_counter() - start, 2),
    }


@hydra.main(config_path=str(CONFIG_DIR), config_name="suffix_index", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    built = run(cfg)
    print(
        f"suffix index {built['output']}: {built['sequences']} sequences, {built['tokens']} tokens, "
        f"{built['nodes']} nodes, {built['bytes']} bytes, built in {built['seconds']} s"
    )


@one_line_errors
def main() -> None:
    check_command_line("suffix_index")  # misspelt keys get our did-you-mean; --help lists this config's keys
    _main()


if __name__ == "__main__":
    main()
