"""Jacobi trajectory collection (CLLM training data): ``python collect_jacobi.py model=... data=sharegpt``.

Prompts are the first user turns of a data config's training split; benchmarks (``eval_only`` data) are
refused. Each rank solves its share of the prompts in batches (``cllm_train/trajectories.py``) and commits
each batch to its shards (``cllm_train/shards.py``), so a run restarted with the same ``output_dir`` resumes.
Records follow ``cllm_train/records.py``. Details: docs/design/methods.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cllm_train.records import model_identity, tokenizer_fingerprint
from cllm_train.shards import ShardWriter, merge_parts
from cllm_train.trajectories import ChunkResult, FilterConfig, Prompt, collect_chunk
from fastdecode.config import ConfigError, ModelConfig, to_dataclass
from fastdecode.data.chat import tokenize_conversation
from fastdecode.data.config import DataConfig, check_data_files, check_trainable
from fastdecode.data.sources import load_records
from fastdecode.files.distributed import world_size
from fastdecode.files.io import check_writable
from fastdecode.files.locks import file_lock
from fastdecode.jacobi import check_block_size
from fastdecode.runtime.loading import load_model, load_tokenizer
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.tokens import IGNORE_INDEX, eos_ids

log = logging.getLogger(__name__)


@dataclass
class CollectJob:
    """``configs/collect_jacobi.yaml``."""

    model: ModelConfig
    data: DataConfig
    output_dir: str
    block_size: int = 32  # n: tokens per Jacobi block (reference: 16 for GSM8K/Spider, 32 for ShareGPT)
    init: str = "prompt"  # y(0): prompt (uniform over the current prefix, as the reference) | vocab
    max_new_seq_len: int = 512  # blocks per prompt: until EOS or this many tokens
    max_prompt_len: int = 256  # longer prompts are skipped (counted in the manifest's "skipped")
    max_prompts: int | None = None  # cap on prompts (after the held-out split and data.max_samples)
    batch_size: int = 8
    labels: bool = True  # store the reference reply ids as "labels"
    seed: int = 0
    filters: FilterConfig = field(default_factory=FilterConfig)
    shard_records: int = 5000
    progress: bool = True

    def __post_init__(self) -> None:
        check_block_size(self.block_size, "block_size")
        if self.init not in ("prompt", "vocab"):
            raise ConfigError(
                f"init={self.init!r}: trajectories start from a random guess; use prompt or vocab."
            )
        for key in ("max_new_seq_len", "max_prompt_len", "batch_size", "shard_records"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)}: must be >= 1.")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"max_prompts={self.max_prompts}: must be >= 1, or null for all.")
        f = self.filters
        if f.max_repeat_run is not None and f.max_repeat_run < 2:
            raise ConfigError(f"filters.max_repeat_run={f.max_repeat_run}: must be >= 2, or null (off).")
        if f.ngram_size is not None and (f.ngram_size < 1 or f.max_ngram_repeats < 1):
            raise ConfigError(
                "filters.ngram_size and filters.max_ngram_repeats must be >= 1 (ngram_size null: off)."
            )


def build_prompts(job: CollectJob, tokenizer: Any, context: int) -> tuple[list[Prompt], Counter]:
    """Every prompt of the job (all ranks), in data order, and the prompts skipped per reason."""
    check_trainable(job.data)  # benchmarks never become training data
    records = load_records(job.data, "train")
    if job.max_prompts is not None:
        records = records[: job.max_prompts]
    blocks = -(-job.max_new_seq_len // job.block_size)
    limit = min(job.max_prompt_len, context - blocks * job.block_size - 1)
    prompts, skipped, seen = [], Counter(), Counter()
    for rec in records:
        messages = rec["messages"]
        user = next((i for i, t in enumerate(messages) if t["role"] == "user"), None)
        if user is None:
            skipped["no_user_turn"] += 1
            continue
        text = tokenizer.apply_chat_template(messages[: user + 1], tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) > limit:
            skipped["prompt_too_long"] += 1
            continue
        labels = None
        if job.labels and user + 1 < len(messages) and messages[user + 1]["role"] == "assistant":
            ex = tokenize_conversation(tokenizer, messages[: user + 2], len(ids) + job.max_new_seq_len)
            labels = [
                t for t, label in zip(ex["input_ids"], ex["labels"], strict=True) if label != IGNORE_INDEX
            ]
        seen[rec["id"]] += 1
        pid = rec["id"] if seen[rec["id"]] == 1 else f"{rec['id']}#{seen[rec['id']]}"  # ids must be unique
        prompts.append(Prompt(pid, ids, labels))
    if not prompts:
        raise ConfigError(
            f"no prompt to collect from data '{job.data.name}' ({len(records)} conversations read, skipped: "
            f"{dict(skipped)}, limit {limit} prompt tokens = min(max_prompt_len, context - max_new_seq_len "
            "rounded up to blocks)); raise max_prompt_len, lower max_new_seq_len, or check the data."
        )
    return prompts, skipped


def plan_batches(prompts: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    """Length-bucketed batches (stable sort by prompt length): little left padding, a deterministic plan."""
    ordered = sorted(prompts, key=lambda p: len(p.ids))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def solve_batch(
    m: EarlyExitModel,
    prompts: list[Prompt],
    job: CollectJob,
    eos_ids: set[int],
    filters: FilterConfig | None = None,
) -> ChunkResult:
    """The trajectories of one batch with the job's block size, initial guess, length and seed, and its
    repetition filters unless ``filters`` is given (the throughput benchmark turns them off)."""
    return collect_chunk(
        m,
        prompts,
        n=job.block_size,
        init=job.init,
        max_new_seq_len=job.max_new_seq_len,
        eos_ids=eos_ids,
        filters=job.filters if filters is None else filters,
        seed=job.seed,
    )


def _distributed() -> tuple[int, int]:
    """``(rank, world size)``, joining the process group of a multi-process launch (gloo: CPU collectives)."""
    world = world_size()
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():  # ranks wait for each other only at the end, so allow long imbalances
        dist.init_process_group("gloo", timeout=timedelta(hours=48))
    return dist.get_rank(), world


def _context(cfg: ModelConfig, path: str | None) -> int:
    """The model's context length (max_position_embeddings), read from its config without the weights."""
    if path is None:
        return cfg.random_init.get("max_position_embeddings", 2048)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).max_position_embeddings


def run(cfg: Any, after_commit: Callable[[int], None] | None = None) -> dict:
    """Collect (or resume) the trajectories of ``cfg``; returns the manifest (merged on rank 0).

    ``after_commit(k)`` is called after the k-th batch committed in this run (tests interrupt through it).
    Two runs into one ``output_dir`` at once are refused (a lock file per rank; a killed run's lock is taken
    over with a log line).
    """
    job = to_dataclass(CollectJob, cfg, "")
    check_trainable(job.data)  # benchmarks never become training data: refused before anything loads
    check_data_files(job.data)
    check_writable(job.output_dir)  # before the tokenizer, the prompts and the model
    rank, world = _distributed()
    from fastdecode.files.assets import model_load_path

    path = None if job.model.source == "random" else str(model_load_path(job.model))
    tokenizer = load_tokenizer(job.model, path)
    context = _context(job.model, path)
    prompts, skipped = build_prompts(job, tokenizer, context)
    lock = Path(job.output_dir) / f".collect.rank{rank}.lock"  # per rank: a second run's ranks all collide
    with file_lock(lock, f"output_dir {job.output_dir} (rank {rank})", wait=False):
        return _collect_locked(job, prompts[rank::world], skipped, tokenizer, rank, world, after_commit)


def _collect_locked(
    job: CollectJob,
    mine: list[Prompt],
    skipped: Counter,
    tokenizer: Any,
    rank: int,
    world: int,
    after_commit: Callable[[int], None] | None,
) -> dict:
    """The part of ``run`` that writes into ``output_dir``, while this rank holds the directory's lock."""
    header = {
        "model": {"id": model_identity(job.model), "name": job.model.name},
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "seed": job.seed,
        "config": dataclasses.asdict(job),
    }
    writer = ShardWriter(job.output_dir, rank, world, header, job.shard_records)
    writer.set_skipped(skipped if rank == 0 else Counter())  # counted over all ranks' prompts: once
    hf, tokenizer = load_model(job.model)
    m = EarlyExitModel(hf)
    todo = [b for b in plan_batches(mine, job.batch_size) if any(p.id not in writer.completed for p in b)]
    _collect(
        m,
        job,
        todo,
        writer,
        eos_ids=eos_ids(hf, tokenizer),
        total=len(mine),
        rank=rank,
        after_commit=after_commit,
    )
    writer.finish()
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    manifest = merge_parts(job.output_dir, world) if rank == 0 else writer.manifest
    if rank == 0:
        _report(manifest, job.output_dir)
    return manifest


def _collect(
    m: EarlyExitModel,
    job: CollectJob,
    batches: list[list[Prompt]],
    writer: ShardWriter,
    *,
    eos_ids: set[int],
    total: int,
    rank: int,
    after_commit: Callable[[int], None] | None,
) -> None:
    """Solve and commit ``batches`` (only their prompts not committed yet), with a tokens/s progress bar."""
    bar = tqdm(
        total=total,
        initial=len(writer.completed),
        unit="prompt",
        desc=f"rank {rank}",
        position=rank,
        disable=not job.progress,
    )
    start, tokens = time.perf_counter(), 0
    for k, batch in enumerate(batches, 1):
        todo = [p for p in batch if p.id not in writer.completed]
        result = solve_batch(m, todo, job, eos_ids)
        writer.commit([p.id for p in todo], result.records, result.filtered, result.forwards, result.tokens)
        tokens += result.tokens
        bar.update(len(todo))
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}", forwards=result.forwards)
        if after_commit is not None:
            after_commit(k)
    bar.close()


def _report(manifest: dict, output_dir: str) -> None:
    """Print what was collected and filtered; an empty result is an error (nothing to train on)."""
    totals = manifest["totals"]
    print(
        f"trajectories in {output_dir}: {totals['records']} records from {totals['prompts']} prompts, "
        f"{totals['tokens']} fixed-point tokens in {totals['forwards']} forwards; "
        f"stopped by filters: {manifest['filters'] or 'none'}; prompts skipped: {manifest['skipped'] or 'none'}"
    )
    if totals["records"] == 0:
        raise ConfigError(
            f"every trajectory in {output_dir} was filtered out (filters: {manifest['filters']}): nothing to "
            "train on. Loosen filters.max_repeat_run / filters.max_ngram_repeats, or use more prompts."
        )
