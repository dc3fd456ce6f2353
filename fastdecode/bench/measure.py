"""The measurement loop: warm-up, then every method on every batch, interleaved, timed with the device synced.

Order: repeat -> (temperature, batch size) -> batch -> method. The method order is rotated by one per batch, so
each method runs first, second, ... equally often. A method whose ``max_batch_size`` is below a batch size is
skipped there, and a greedy-only method at temperatures > 0, with the reason recorded.

Per call: TTFT first (the same call with ``max_new_tokens=1``, when ``ttft`` is on), then the full call. Peak
memory: ``torch.cuda.max_memory_allocated`` reset before each call on a GPU; on a CPU the process's peak RSS
(monotonic, so it mostly reflects the largest method and the loaded weights).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from fastdecode.bench.config import Method, SpeedJob
from fastdecode.bench.engines import count_layers
from fastdecode.bench.stats import Record

Prompt = tuple[str, list[int]]


def sync(device: torch.device) -> None:
    """Wait for queued device work, so the clock measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rss_peak_mb() -> float | None:
    """The process's peak resident set size so far, in MB (Linux ``ru_maxrss`` is in KB)."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except (ImportError, OSError):  # pragma: no cover - not on Linux
        return None


def timed(runner: Callable, prompts: list[list[int]], budget: int, temperature: float, seed: int, device):
    """``(output, seconds, peak memory MB or None)`` of one call, the device synchronised around the clock."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    out = runner(prompts, budget, temperature, seed)
    sync(device)
    seconds = time.perf_counter() - start
    memory = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else rss_peak_mb()
    return out, seconds, memory


def batches(prompts: list[Prompt], size: int) -> list[list[Prompt]]:
    """Consecutive batches of ``size`` prompts (the last one may be smaller)."""
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]


def runnable(methods: list[Method], size: int, temperature: float) -> tuple[list[Method], list[dict]]:
    """The methods that accept batch ``size`` at ``temperature``, and a skip entry for each of the others."""
    keep, skipped = [], []
    for m in methods:
        limit, reason = m.spec.max_batch_size, None
        if limit is not None and size > limit:
            reason = f"supports batch size <= {limit} only (e.g. HF assisted generation raises for batch > 1)"
        elif temperature > 0 and not m.spec.sampling:
            reason = "greedy only (sampling: false in its decoder config)"
        if reason:
            skipped.append(
                {"method": m.name, "batch_size": size, "temperature": temperature, "reason": reason}
            )
        else:
            keep.append(m)
    return keep, skipped


def warm_up(
    job: SpeedJob, methods: list[Method], runners: dict, first: list[list[int]], temperature: float, size: int
) -> dict:
    """Untimed calls on the first batch; for HF methods also the layer-counting pass. Returns the counts."""
    counted = {}
    for m in methods:
        runner = runners[m.name]
        for _ in range(job.warmup):
            runner(first, job.max_new_tokens, temperature, job.seed)
            if job.ttft:
                runner(first, 1, temperature, job.seed)
        if not runner.counters and job.count_hf_layers:
            counted[(m.name, temperature, size)] = count_layers(
                runner, first, job.max_new_tokens, temperature
            )
    return counted


def run_batch(
    job: SpeedJob,
    active: list[Method],
    runners: dict,
    group: list[Prompt],
    where: tuple,
    device: torch.device,
) -> list[Record]:
    """Every active method on one batch, in rotated order. ``where`` = (repeat, temperature, size, index)."""
    repeat, temperature, size, index = where
    ids, seed = [p for _, p in group], job.seed + index
    shift = (index + repeat) % len(active) if active else 0
    records = []
    for m in active[shift:] + active[:shift]:
        runner = runners[m.name]
        ttft = timed(runner, ids, 1, temperature, seed, device)[1] if job.ttft else None
        out, seconds, memory = timed(runner, ids, job.max_new_tokens, temperature, seed, device)
        records.append(
            Record(
                method=m.name,
                repeat=repeat,
                temperature=temperature,
                batch_size=size,
                batch=index,
                prompt_ids=[pid for pid, _ in group],
                out=out,
                wall_time_s=seconds,
                ttft_s=ttft,
                peak_memory_mb=memory,
                counters=runner.counters,
            )
        )
    return records


def measure(
    job: SpeedJob,
    methods: list[Method],
    runners: dict,
    prompts: list[Prompt],
    device: torch.device,
) -> tuple[list[Record], list[dict], dict]:
    """Run the benchmark; returns ``(records, skipped, HF layer counts keyed by (method, temperature, size))``."""
    from tqdm.auto import tqdm

    plans, skipped, hf_layers = [], [], {}
    for temperature, size in itertools.product(job.temperatures, job.batch_sizes):
        active, skip = runnable(methods, size, temperature)
        skipped += skip
        groups = batches(prompts, size)
        plans.append((temperature, size, active, groups))
        hf_layers |= warm_up(job, active, runners, [p for _, p in groups[0]], temperature, size)
    total = job.repeats * sum(len(a) * len(g) for _, _, a, g in plans)
    records: list[Record] = []
    with tqdm(total=total, desc="speed", disable=not job.progress, unit="call") as bar:
        for repeat, (temperature, size, active, groups) in itertools.product(range(job.repeats), plans):
            for index, group in enumerate(groups):
                records += run_batch(job, active, runners, group, (repeat, temperature, size, index), device)
                bar.update(len(active))
    return records, skipped, hf_layers
