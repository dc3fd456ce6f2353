"""Dataset readers. Every reader returns records: ``{"id": str, "messages": [{"role", "content"}, ...], ...}``.

Roles are ``system``, ``user`` and ``assistant``. Evaluation sets carry user turns only, plus their own fields
(MT-bench: ``turns``, ``category``, ``question_id``; HumanEval: ``task_id``, ``prompt``, ``entry_point``, ...).

Training conversations are cleaned by ``clean_conversation`` (same rules for every source): leading assistant
turns and a trailing unanswered user turn are trimmed; a conversation is dropped when a turn is empty, a system
message sits after the first turn, the turns do not alternate user/assistant, or no assistant turn is left.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.data.config import DataConfig, require_path
from fastdecode.data.repeated import repeated_records
from fastdecode.data.splits import SPLITS, split_parts

logger = logging.getLogger(__name__)

ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
_SEPARATORS = re.compile(r"[\s,]*")


@dataclass
class ReadStats:
    """What a reader saw: ``read`` raw records, ``kept`` after cleaning, reasons for drops and trims."""

    read: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    trimmed: Counter = field(default_factory=Counter)
    truncated_at: int | None = None  # character offset of an incomplete final record, if the file ends early

    def log(self, what: str) -> None:
        drops = ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items())) or "none"
        trims = ", ".join(f"{n} {why}" for why, n in sorted(self.trimmed.items())) or "none"
        logger.info(
            "%s: read %d, kept %d; dropped: %s; trimmed: %s", what, self.read, self.kept, drops, trims
        )


def to_messages(turns: Any) -> list[dict[str, str]]:
    """Turns as ``role``/``content`` dicts; accepts ShareGPT ``from``/``value``. ValueError says what is wrong."""
    if not isinstance(turns, list):
        raise ValueError(f"messages must be a list of turns, got {type(turns).__name__}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"turn {i} is a {type(turn).__name__}, expected an object")
        role = turn.get("role") or turn.get("from")  # datasets fills absent struct keys with None
        content = turn["content"] if turn.get("content") is not None else turn.get("value")
        if role not in ROLE_MAP:
            raise ValueError(f"turn {i} has role {role!r}; expected one of {', '.join(sorted(ROLE_MAP))}")
        if not isinstance(content, str):
            raise ValueError(f"turn {i} has no string 'content' (or 'value'), got {content!r:.60}")
        out.append({"role": ROLE_MAP[role], "content": content})
    return out


def clean_conversation(messages: list[dict[str, str]], stats: ReadStats) -> list[dict[str, str]] | None:
    """Apply the training rules of the module docstring; return None (and count why) to drop."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system) :]
    reason = None
    if any(not m["content"].strip() for m in messages):
        reason = "empty_turn"
    elif any(m["role"] == "system" for m in turns):
        reason = "system_not_first"
    else:
        lead = next((i for i, m in enumerate(turns) if m["role"] != "assistant"), len(turns))
        if lead:
            stats.trimmed["leading_assistant"] += 1
            turns = turns[lead:]
        if turns and turns[-1]["role"] == "user":
            stats.trimmed["trailing_user"] += 1
            turns = turns[:-1]
        if not turns:
            reason = "no_assistant"
        elif any(m["role"] != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(turns)):
            reason = "not_alternating"
    if reason:
        stats.dropped[reason] += 1
        return None
    return system + turns


def iter_json_array(path: Path, stats: ReadStats, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Stream the elements of a JSON array file, tolerating a file cut off mid-element.

    Every complete element is yielded; if the file ends early, ``stats.truncated_at`` is set to the character
    offset of the incomplete element and a WARNING is logged. Memory stays at about one chunk plus one element.
    """
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    buf, pos, base, eof = "", 0, 0, False  # base: absolute offset of buf[0]
    with open(path, "rb") as f:

        def more() -> bool:
            nonlocal buf, pos, base, eof
            raw = f.read(chunk_chars)
            try:
                text = utf8.decode(raw, final=not raw)
            except UnicodeDecodeError:  # the file ends inside a multi-byte character
                text = ""
            eof = not raw
            buf, base, pos = buf[pos:] + text, base + pos, 0
            return bool(raw)

        while not eof and not buf.strip():
            more()
        if not buf.lstrip().startswith("["):
            raise ConfigError(f"{path}: expected a JSON array (the file should start with '[').")
        pos = buf.index("[") + 1
        while True:
            pos = _SEPARATORS.match(buf, pos).end()
            if pos >= len(buf) and more():
                continue
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if more():
                    continue
                stats.truncated_at = base + pos
                logger.warning(
                    "%s ends early: incomplete record at character offset %d (%d characters not parsed); "
                    "read the %d complete records before it.",
                    path,
                    base + pos,
                    len(buf) - pos,
                    stats.read,
                )
                return
            if end == len(buf) and not isinstance(item, (dict, list)) and more():
                continue  # a number or literal touching the chunk end may go on in the next chunk
            stats.read += 1
            pos = end
            yield item


def read_sharegpt(path: str | Path) -> tuple[list[dict], ReadStats]:
    """ShareGPT JSON (possibly truncated) as cleaned conversations, and the read/drop statistics."""
    stats, records = ReadStats(), []
    for i, raw in enumerate(iter_json_array(Path(path), stats)):
        raw = raw if isinstance(raw, dict) else {}
        try:
            messages = to_messages(raw.get("conversations"))
        except ValueError:
            stats.dropped["malformed"] += 1
            continue
        messages = clean_conversation(messages, stats)
        if messages is not None:
            records.append({"id": str(raw.get("id", f"sharegpt:{i}")), "messages": messages})
    stats.kept = len(records)
    stats.log(f"sharegpt {path}")
    return records, stats


def read_mt_bench(path: str | Path) -> list[dict]:
    """MT-bench ``question.jsonl``: one record per question; ``messages`` holds the first turn, ``turns`` all."""
    records = []
    for row in _jsonl_rows(Path(path)):
        qid = row["question_id"]
        rec = {"id": f"mt_bench/{qid}", "messages": [{"role": "user", "content": row["turns"][0]}]}
        records.append(rec | {k: v for k, v in row.items() if k != "messages"})
    logger.info("mt_bench %s: %d questions", path, len(records))
    return records


def read_humaneval(path: str | Path) -> list[dict]:
    """HumanEval (``.jsonl`` or ``.jsonl.gz``): the code ``prompt`` is the user turn; all fields are kept."""
    records = [
        {"id": row["task_id"], "messages": [{"role": "user", "content": row["prompt"]}]} | row
        for row in _jsonl_rows(Path(path))
    ]
    logger.info("humaneval %s: %d problems", path, len(records))
    return records


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(1-based line number, text)`` of a (gzipped) text file; a non-UTF-8 line names file, line, byte."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(
                    f"{path}, line {lineno}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                    f"{err.start + 1}); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)."
                ) from None


def _jsonl_rows(path: Path) -> Iterator[Any]:
    for lineno, line in _text_lines(path):
        if line.strip():
            try:
                yield json.loads(line)
            except ValueError as err:
                raise ConfigError(f"{path}, line {lineno}: {err}") from err


def row_to_messages(row: dict, cfg: DataConfig) -> list[dict[str, str]]:
    """A jsonl/hf row as messages: ``messages_field`` (or messages/conversations), else prompt/response."""
    names = [cfg.messages_field] if cfg.messages_field else ["messages", "conversations"]
    for name in names:
        if name in row:
            return to_messages(row[name])
    prompt, response = row.get(cfg.prompt_field), row.get(cfg.response_field)
    if isinstance(prompt, str) and isinstance(response, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    raise ValueError(
        f"expected a '{'/'.join(names)}' list or string '{cfg.prompt_field}' and '{cfg.response_field}' "
        f"fields; found keys {sorted(row)}"
    )


def read_jsonl(path: str | Path, cfg: DataConfig) -> tuple[list[dict], ReadStats]:
    """Local jsonl of conversations; a malformed line raises ConfigError naming the file and 1-based line."""
    path, stats, records = Path(path), ReadStats(), []
    if not path.is_file():
        raise ConfigError(f"data '{cfg.name}': data.path={path} is not a file.")
    for lineno, line in _text_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            messages = row_to_messages(row, cfg)
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            raise ConfigError(f"{path}, line {lineno}: {err}") from err
        stats.read += 1
        messages = clean_conversation(messages, stats)
        if messages is not None:
            records.append({"id": str(row.get("id", f"{path.name}:{lineno}")), "messages": messages})
    stats.kept = len(records)
    stats.log(f"jsonl {path}")
    return records, stats


def read_hf(cfg: DataConfig) -> tuple[list[dict], ReadStats]:
    """``datasets.load_dataset`` rows (messages, ShareGPT conversations, or prompt/response columns)."""
    import datasets

    ds = datasets.load_dataset(cfg.hf_name, cfg.hf_config, split=cfg.hf_split, data_files=cfg.hf_data_files)
    stats, records = ReadStats(), []
    for i, row in enumerate(ds):
        try:
            messages = row_to_messages(row, cfg)
        except ValueError as err:
            raise ConfigError(
                f"data '{cfg.name}': {cfg.hf_name} split {cfg.hf_split} row {i}: {err}"
            ) from err
        stats.read += 1
        messages = clean_conversation(messages, stats)
        if messages is not None:
            records.append({"id": str(row.get("id") or f"{cfg.hf_name}:{i}"), "messages": messages})
    stats.kept = len(records)
    stats.log(f"hf {cfg.hf_name} ({cfg.hf_split})")
    return records, stats


def _packaged_file(cfg: DataConfig) -> Path:
    if cfg.path:
        if not Path(cfg.path).is_file():
            raise ConfigError(f"data '{cfg.name}': data.path={cfg.path} is not a file.")
        return Path(cfg.path)
    from fastdecode.files.assets import ensure_pypi_file

    return ensure_pypi_file(cfg.pypi)


def read_records(cfg: DataConfig) -> list[dict]:
    """Every record of ``cfg``'s source (no split, no ``max_samples``), ``system_prompt`` prepended where the
    conversation has no system message."""
    return read_records_with_stats(cfg)[0]


def read_records_with_stats(cfg: DataConfig) -> tuple[list[dict], ReadStats]:
    """``read_records`` and what the reader saw (raw records read, dropped per reason); benchmarks, which
    are not cleaned, count every question as read and kept."""
    readers = {
        "sharegpt": lambda: read_sharegpt(_packaged_file(cfg)),
        "mt_bench": lambda: _all_kept(read_mt_bench(_packaged_file(cfg))),
        "humaneval": lambda: _all_kept(read_humaneval(_packaged_file(cfg))),
        "jsonl": lambda: read_jsonl(require_path(cfg), cfg),
        "hf": lambda: read_hf(cfg),
        "repeated": lambda: _all_kept(repeated_records(cfg.split_seed)),
    }
    if cfg.source not in readers:
        raise unknown_name_error("data source", cfg.source, list(readers))
    records, stats = readers[cfg.source]()
    if cfg.system_prompt:
        for rec in records:
            if rec["messages"][0]["role"] != "system":
                rec["messages"].insert(0, {"role": "system", "content": cfg.system_prompt})
    return records, stats


def _all_kept(records: list[dict]) -> tuple[list[dict], ReadStats]:
    return records, ReadStats(read=len(records), kept=len(records))


def load_records(cfg: DataConfig, split: str = "all") -> list[dict]:
    """``cfg``'s records; ``split`` is all | train | held_out | grounded (``fastdecode/data/splits.py``).

    ``max_samples`` caps "train" (after the split, so the set-aside parts do not depend on it) and "all"
    (e.g. the first N benchmark questions); "held_out" and "grounded" are never capped.
    """
    return load_split(cfg, split)[0]


def load_split(cfg: DataConfig, split: str = "all") -> tuple[list[dict], int]:
    """``load_records`` and how many records of the set-aside ``split`` (held_out, grounded) were dropped for a
    twin in the training split (``splits.split_parts``; 0 for all and train)."""
    if split not in SPLITS:
        raise unknown_name_error("data split", split, list(SPLITS))
    records, twins = read_records(cfg), 0
    if split != "all":
        parts = split_parts(records, cfg.held_out, cfg.split_seed, cfg.grounded)
        records, twins = getattr(parts, split), parts.twins.get(split, 0)
    if split in ("all", "train") and cfg.max_samples is not None:
        records = records[: cfg.max_samples]
    return records, twins
