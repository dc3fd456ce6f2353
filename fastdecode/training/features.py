"""The frozen model's work, paid once: layer-E features and the final layer's targets, cached to disk.

``cache_training_features`` writes one record per training sequence (computed by ``feature_records.py``)
into crash-safe shards (``fastdecode.files.tensor_shards``); ``FeatureDataset`` and ``collate_features`` read
them back for training. A cache is refused for another model, tokenizer or settings, and a complete one serves
any subset of its exits. The record's fields: docs/design/training.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fastdecode.data.chat import user_prompt_ids
from fastdecode.drafters.exits.adapter import base_identity, check_base
from fastdecode.files.io import check_free_space
from fastdecode.files.locks import file_lock
from fastdecode.files.tensor_shards import MANIFEST, ShardHeaderError, ShardReader, ShardWriter, check_header
from fastdecode.runtime.engine import default_options
from fastdecode.runtime.machine import machine_label
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.runtime.progress import human_seconds, phase
from fastdecode.tokens import eos_ids
from fastdecode.training.answers import generated_answers, write_answers
from fastdecode.training.feature_config import FeatureConfig
from fastdecode.training.feature_records import batch_features, generation_features, scored_positions

log = logging.getLogger(__name__)
SCHEMA = 1
DATA_KEYS = (
    "name",
    "source",
    "path",
    "max_length",
    "max_samples",
    "held_out",
    "split_seed",
    "assistant_only_loss",
    "packing",
    "system_prompt",
)


def feature_header(
    m: EarlyExitModel, tokenizer: Any, fcfg: FeatureConfig, exits: list[int], data: Any
) -> dict:
    """What the cached records depend on (checked on resume and before training)."""
    data_id = {k: getattr(data, k, None) for k in DATA_KEYS} if dataclasses.is_dataclass(data) else data
    return {
        "schema": SCHEMA,
        "base": base_identity(m, tokenizer),
        "exits": sorted(exits),
        "top_k": fcfg.top_k,
        "dtype": fcfg.dtype,
        "data": data_id,
        "weights": m.resolve_weights(fcfg.weights).key,  # what the frozen model's products read
    }


def _check_existing(directory: Path, header: dict, m: EarlyExitModel, tokenizer: Any) -> dict | None:
    """The existing manifest of ``directory`` (None if there is none), refused for another model/settings.
    (``max_records`` is not a setting: records are a prefix of one fixed order, so a larger value extends
    a cache and a smaller one trains on its first records.)"""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    found = ShardReader(directory).manifest
    check_base(found["header"].get("base", {}), m, tokenizer, where=f"the feature cache {directory}")
    keys = [k for k in header if k not in ("base", "exits")]
    check_header(found["header"], header, path, keys)
    cached, wanted = found["header"]["exits"], header["exits"]
    if found.get("complete"):
        if not set(wanted) <= set(cached):
            raise ShardHeaderError(
                f"{path} caches exits {cached}, not {sorted(set(wanted) - set(cached))}: cache them in another "
                "directory (recipe.features.dir), or train at cached exits."
            )
    elif cached != wanted:
        raise ShardHeaderError(
            f"{path} is an unfinished cache of exits {cached}; resume it with recipe.features.exits={cached}."
        )
    return found


def generation_prompts(train: list[dict], tokenizer, max_prompt_tokens: int) -> list[dict]:
    """Chat-templated first user turns of the training examples (at most ``max_prompt_tokens``), in order,
    with their text (``prompt``)."""
    out = []
    for ex in train:
        if ex.get("prompt", "").strip():
            ids = user_prompt_ids(tokenizer, ex["prompt"])
            if len(ids) <= max_prompt_tokens:
                out.append({"input_ids": ids, "prompt": ex["prompt"]})
    return out


def batch_order(examples: list[dict], batch_size: int) -> list[int]:
    """Example indices in caching order: dataset order, sorted by length within windows of 8 batches (less
    padding); deterministic, so a resumed run continues the same order."""
    window = 8 * batch_size
    order = []
    for start in range(0, len(examples), window):
        chunk = range(start, min(start + window, len(examples)))
        order += sorted(chunk, key=lambda i: (-len(examples[i]["input_ids"]), i))
    return order


def cache_bytes(examples: list[dict], fcfg: FeatureConfig, exits: int, hidden: int) -> int:
    """Bytes the cache of ``examples`` will take (``FeatureConfig.record_bytes``); with ``source=generate``
    a lower bound: the answers' lengths are unknown before they are generated, each counts one token."""
    if fcfg.source == "generate":
        sizes = [(len(ex["input_ids"]) + 1, 1) for ex in examples]
    else:
        sizes = [(len(ex["input_ids"]), len(scored_positions(ex["labels"]))) for ex in examples]
    return sum(fcfg.record_bytes(t, n, exits=exits, hidden=hidden) for t, n in sizes)


def _open_writer(
    m: EarlyExitModel, directory: Path, header: dict, fcfg: FeatureConfig, ordered: list[dict]
) -> ShardWriter:
    """The shard writer, resumed where the cache stopped, after checking the disk has room for the rest."""
    lower = "recipe.features.max_records, recipe.features.exits or recipe.features.dtype=bfloat16"
    writer = ShardWriter(directory, header, fcfg.shard_records, lower=lower)
    todo = ordered[writer.records :]
    needed = cache_bytes(todo, fcfg, len(header["exits"]), m.config.hidden_size)
    check_free_space(directory, needed, "the feature cache", lower)
    if writer.complete:
        writer.reopen()
    return writer


def build_features(
    m: EarlyExitModel,
    tokenizer: Any,
    examples: list[dict],
    directory: str | Path,
    fcfg: FeatureConfig,
    *,
    exits: list[int],
    data: Any,
    on_commit: Callable[[int], None] | None = None,
    eos: set[int] | None = None,
) -> ShardReader:
    """Cache the records of ``examples`` (the training split; with ``fcfg.source=generate`` only their
    ``input_ids`` are used, as prompts, and ``eos`` ends answers) in ``directory``, resuming an unfinished
    cache; a complete one is checked and reused. Returns the reader; the manifest's ``stats`` hold counts and
    the frozen model's positions per second."""
    directory = Path(directory)
    cached_exits = sorted(exits)
    header = feature_header(m, tokenizer, fcfg, cached_exits, data)
    found = _check_existing(directory, header, m, tokenizer)
    order = batch_order(examples, fcfg.batch_size)
    if fcfg.max_records is not None:
        order = order[: fcfg.max_records]
    if found is not None and found.get("complete") and found["records"] >= len(order):
        log.info("features: reusing the complete cache %s (%d records)", directory, found["records"])
        return ShardReader(directory, limit=len(order))
    if found is not None:
        header["exits"] = cached_exits = found["header"]["exits"]
    writer = _open_writer(m, directory, header, fcfg, [examples[i] for i in order])
    started = time.perf_counter()
    was_training, engine = m.hf.training, m.engine
    m.hf.eval()
    m.use_engine(default_options(m.device, weights=m.resolve_weights(fcfg.weights)))
    todo = len(order) - writer.records
    what = f"the frozen model's features at exits {cached_exits} of {todo} sequences ({fcfg.source}) into {directory}"
    try:
        with phase("features", what, total=todo, unit="sequence", logger=log) as progress:
            for b in range(writer.records, len(order), fcfg.batch_size):
                chosen = order[b : b + fcfg.batch_size]
                tick = time.perf_counter()
                records = _feature_records(m, [examples[i] for i in chosen], cached_exits, fcfg, eos=eos)
                _write_records(
                    writer, chosen, records, seconds=time.perf_counter() - tick, on_commit=on_commit
                )
                progress.update(len(chosen))
    finally:
        m.hf.train(was_training)
        m.use_engine(None if engine is None else engine.options)
    writer.finish()
    manifest = writer.finish(summary=_summary(writer.manifest["stats"], len(order), started, m.device))
    log.info("features: %s", summary_text(manifest["summary"]))
    return ShardReader(directory, limit=len(order))


def cache_training_features(
    m: EarlyExitModel,
    tokenizer: Any,
    train: list[dict],
    directory: str | Path,
    fcfg: FeatureConfig,
    *,
    exits: list[int],
    data: Any,
) -> ShardReader:
    """``build_features`` on the training split as ``fcfg.source`` says: its conversations teacher-forced
    (``data``), or the model's own greedy answers to their first user turns (``generate``, ending at the
    model's EOS ids; the answers also written as ``answers.jsonl`` beside the cache, ``answers.py``). One
    process at a time (a file lock beside the cache): the ranks of a launch, or runs sharing a cache, wait
    for the one building it, then find it complete."""
    sources, eos = train, None
    if fcfg.source == "generate":
        sources = generation_prompts(train, tokenizer, fcfg.max_prompt_tokens)
        eos = eos_ids(m.hf, tokenizer)
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(directory.parent / f"{directory.name}.lock", f"the feature cache {directory}"):
        reader = build_features(m, tokenizer, sources, directory, fcfg, exits=exits, data=data, eos=eos)
        if fcfg.source == "generate":
            write_answers(directory, generated_answers(reader, sources, tokenizer))
        return reader


def _feature_records(
    m: EarlyExitModel, batch: list[dict], exits: list[int], fcfg: FeatureConfig, *, eos: set[int] | None
) -> list[dict[str, torch.Tensor]]:
    """The records of one batch of examples: teacher-forced, or generated from their prompts."""
    dtype = getattr(torch, fcfg.dtype)
    if fcfg.source != "generate":
        return batch_features(m, batch, exits, fcfg.top_k, dtype)
    prompts = [ex["input_ids"] for ex in batch]
    return generation_features(
        m, prompts, exits, fcfg.top_k, dtype, max_new_tokens=fcfg.max_new_tokens, eos=eos or set()
    )


def _write_records(
    writer: ShardWriter,
    chosen: list[int],
    records: list[dict[str, torch.Tensor]],
    *,
    seconds: float,
    on_commit: Callable[[int], None] | None,
) -> None:
    """Add one batch's records (with their example index) and its counts; the batch's ``seconds`` count
    once."""
    for i, (index, record) in enumerate(zip(chosen, records, strict=True)):
        stats = {"positions": len(record["input_ids"]), "scored": len(record["scored"])}
        if i == 0:
            stats["seconds"] = seconds
        committed = writer.add(record | {"index": torch.tensor([index])}, stats)
        if committed and on_commit is not None:
            on_commit(writer.records)


def _summary(stats: dict, sequences: int, started: float, device: torch.device) -> dict:
    """The cache's summary: counts, and the frozen model's positions per second, with the machine they were
    measured on (this run's: a resumed cache's earlier parts may have run elsewhere)."""
    seconds = max(stats.get("seconds", 0.0), 1e-9)
    return {
        "sequences": sequences,
        "positions": stats.get("positions", 0),
        "scored_positions": stats.get("scored", 0),
        "seconds": stats.get("seconds", 0.0),
        "positions_per_s": stats.get("positions", 0) / seconds,
        "scored_positions_per_s": stats.get("scored", 0) / seconds,
        "this_run_seconds": time.perf_counter() - started,
        "measured_on": machine_label(device),
    }


def summary_text(summary: dict) -> str:
    """The cache's summary as one sentence."""
    return (
        f"{summary['sequences']} sequences, {summary['positions']} positions ({summary['scored_positions']} "
        f"scored) at {summary['positions_per_s']:.0f} positions/s on {summary['measured_on']}; "
        f"{human_seconds(summary['this_run_seconds'])} in this run"
    )


# --------------------------------------------------------------------------------------------------------
# Training examples from the cache
class FeatureDataset(torch.utils.data.Dataset):
    """The cached records as training examples: only the fields the loss needs (lazy reads)."""

    def __init__(self, reader: ShardReader, exits: list[int], target: str) -> None:
        self.reader, self.exits = reader, list(exits)
        missing = sorted(set(exits) - set(reader.header["exits"]))
        if missing:
            raise ShardHeaderError(f"the feature cache {reader.dir} has no exits {missing}")
        self.fields = ["scored", "targets", "teacher"] + [f"h{e}" for e in exits]
        self.fields += ["final"] if target == "full" else ["topk_ids", "topk_logp"]

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.reader.read(i, self.fields)


def collate_features(records: list[dict[str, torch.Tensor]], exits: list[int]) -> dict[str, Any]:
    """Right-padded batch: ``hidden[str(E)] [B, T, H]`` (float32), ``position_ids [B, T]``, the scored
    positions flattened (``rows``, ``cols`` [M]) and their targets ``[M, ...]``."""
    lengths = [r[f"h{exits[0]}"].shape[0] for r in records]
    batch, width = len(records), max(lengths)
    hidden = {}
    for e in exits:
        size = records[0][f"h{e}"].shape[-1]
        padded = torch.zeros(batch, width, size)
        for row, r in enumerate(records):
            padded[row, : lengths[row]] = r[f"h{e}"].float()
        hidden[str(e)] = padded
    rows = torch.cat([torch.full((len(r["scored"]),), row) for row, r in enumerate(records)])
    out = {
        "hidden": hidden,
        "position_ids": torch.arange(width).expand(batch, -1).contiguous(),
        "rows": rows.long(),
        "cols": torch.cat([r["scored"] for r in records]).long(),
        "targets": torch.cat([r["targets"] for r in records]).long(),
        "teacher": torch.cat([r["teacher"] for r in records]).long(),
    }
    if "final" in records[0]:
        out["final"] = torch.cat([r["final"] for r in records]).float()
    if "topk_ids" in records[0]:
        out["topk_ids"] = torch.cat([r["topk_ids"] for r in records]).long()
        out["topk_logp"] = torch.cat([r["topk_logp"] for r in records]).float()
    return out
