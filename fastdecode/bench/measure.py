"""The measurement loop: warm-up, then every method on every batch, interleaved, timed with the device synced.

It owns the schedule and the line that says what will run (``plan_line``), the warm-up, the timed calls
(TTFT and peak memory included) and the skips: a batch above a method's ``max_batch_size``, a greedy-only
method at temperature > 0. Order, rotation and memory details: docs/design/bench.md.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastdecode.bench.config import Method, SpeedJob
from fastdecode.bench.engines import count_layers
from fastdecode.bench.stats import Record
from fastdecode.registry import forget_earlier_calls

Prompt = tuple[str, list[int]]
log = logging.getLogger(__name__)


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


def timed(runner: Callable, prompts: list[list[int]], budget: int, *, temperature: float, seed: int, device):
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
    job: SpeedJob,
    methods: list[Method],
    runners: dict,
    first: list[list[int]],
    *,
    temperature: float,
    size: int,
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
    *,
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
        ttft = (
            timed(runner, ids, 1, temperature=temperature, seed=seed, device=device)[1] if job.ttft else None
        )
        out, seconds, memory = timed(
            runner, ids, job.max_new_tokens, temperature=temperature, seed=seed, device=device
        )
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


@dataclass
class Setting:
    """One (temperature, batch size) of the job: the methods that run there and the batches of prompts."""

    temperature: float
    size: int
    active: list[Method]
    groups: list[list[Prompt]]


def schedule(job: SpeedJob, methods: list[Method], prompts: list[Prompt]) -> tuple[list[Setting], list[dict]]:
    """Every (temperature, batch size) with its runnable methods and batches, and the skip entries."""
    settings, skipped = [], []
    for temperature, size in itertools.product(job.temperatures, job.batch_sizes):
        active, skip = runnable(methods, size, temperature)
        skipped += skip
        settings.append(Setting(temperature, size, active, batches(prompts, size)))
    return settings, skipped


def call_counts(job: SpeedJob, settings: list[Setting]) -> tuple[int, int]:
    """``(timed calls, untimed warm-up calls)``: a call is one method on one batch; TTFT calls not included;
    warm-ups are ``warmup`` per method and setting (doubled with TTFT) plus two layer-counting calls per HF
    method (``count_hf_layers``)."""
    timed_calls = job.repeats * sum(len(s.active) * len(s.groups) for s in settings)
    per_method = job.warmup * (2 if job.ttft else 1)
    warm = sum(
        per_method + (2 if job.count_hf_layers and m.spec.engine == "hf" else 0)
        for s in settings
        for m in s.active
    )
    return timed_calls, warm


def plan_line(job: SpeedJob, methods: list[Method], prompts: list[Prompt], settings: list[Setting]) -> str:
    """The one line said before measuring: ``<M> methods x <P> prompts x <R> repeats = <C> timed calls (+ <W>
    warm-up calls)``, with what changes the product (several settings, batches, skips, TTFT)."""
    timed_calls, warm = call_counts(job, settings)
    head = f"{len(methods)} methods x {len(prompts)} prompts x {job.repeats} repeats"
    if len(settings) > 1:
        head += f" x {len(settings)} (temperature, batch size) settings"
    notes = []
    if any(s.size > 1 for s in settings):
        notes.append("a batch of prompts is one call")
    if any(len(s.active) < len(methods) for s in settings):
        notes.append("skipped methods not counted")
    if job.ttft:
        notes.append("each timed call after a timed max_new_tokens=1 call (TTFT)")
    suffix = f"; {', '.join(notes)}" if notes else ""
    return f"{head} = {timed_calls} timed calls (+ {warm} warm-up calls){suffix}"


def measure(
    job: SpeedJob,
    methods: list[Method],
    runners: dict,
    prompts: list[Prompt],
    device: torch.device,
) -> tuple[list[Record], list[dict], dict]:
    """Say what will run (``plan_line``: printed and logged), warm up, then run the benchmark; returns
    ``(records, skipped, HF layer counts keyed by (method, temperature, size))``."""
    from tqdm.auto import tqdm

    settings, skipped = schedule(job, methods, prompts)
    line = plan_line(job, methods, prompts, settings)
    log.info(line)
    print(line, flush=True)
    hf_layers: dict = {}
    for s in settings:
        first = [p for _, p in s.groups[0]]
        hf_layers |= warm_up(job, s.active, runners, first, temperature=s.temperature, size=s.size)
    total, _ = call_counts(job, settings)
    records: list[Record] = []
    desc = f"speed: {len(methods)} methods x {len(prompts)} prompts"
    with tqdm(total=total, desc=desc, disable=not job.progress, unit="call") as bar:
        for repeat, s in itertools.product(range(job.repeats), settings):
            forget_earlier_calls()  # a pass over the prompts: none of their answers is in a drafter's memory
            for index, group in enumerate(s.groups):
                where = (repeat, s.temperature, s.size, index)
                records += run_batch(job, s.active, runners, group, where=where, device=device)
                bar.update(len(s.active))
    return records, skipped, hf_layers
