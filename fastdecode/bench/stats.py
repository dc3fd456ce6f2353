"""Per-call records and their summary: throughput, speedups, acceptance, token match, the oracle report.

Counting is the same for every method: ``new_tokens`` is the number of generated ids per row, EOS included
once, nothing after it (``engines.cut_at_eos``). Speedups are ratios against the baselines of the same run,
prompts, temperature and batch size. How throughput, acceptance and ragged drafts are counted:
docs/design/bench.md.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from fastdecode.decoding.config import DecodeOutput


@dataclass(kw_only=True)
class Record:
    """One timed call of one method on one batch of prompts."""

    method: str
    repeat: int
    temperature: float
    batch_size: int
    batch: int
    prompt_ids: list[str]
    out: DecodeOutput
    wall_time_s: float
    ttft_s: float | None
    peak_memory_mb: float | None
    counters: bool  # the method reports steps / acceptance / layers (our decoders)
    match: list[tuple[int, int, int | None]] = field(default_factory=list)  # per row, vs the baseline
    categories: list[str | None] | None = None  # per row, the prompt's category (sets that have them)

    @property
    def key(self) -> tuple:
        return self.repeat, self.temperature, self.batch_size, self.batch

    def to_json(self) -> dict:
        out, rows = self.out, [len(row) for row in self.out.tokens]
        tpot = None
        if self.ttft_s is not None and max(rows) > 1:
            tpot = 1000 * (self.wall_time_s - self.ttft_s) / (max(rows) - 1)
        matched, compared = sum(m[0] for m in self.match), sum(m[1] for m in self.match)
        return {
            "method": self.method,
            "repeat": self.repeat,
            "temperature": self.temperature,
            "batch_size": self.batch_size,
            "batch": self.batch,
            "prompt_ids": self.prompt_ids,
            "categories": self.categories,
            "new_tokens": out.num_tokens,
            "tokens_per_row": rows,
            "wall_time_s": self.wall_time_s,
            "ttft_s": self.ttft_s,
            "tpot_ms": tpot,
            "decode_steps": out.steps if self.counters else None,
            "accept_lengths": [a + 1 for a in out.accepted] if self.counters else None,
            "oracle": list(out.oracle) if self.counters else None,
            "layers_run": out.layers_run if self.counters else None,
            "layer_calls": out.layer_calls if self.counters else None,
            "peak_memory_mb": self.peak_memory_mb,
            "match_rate": matched / compared if compared else None,
            "first_divergence": [m[2] for m in self.match] if self.match else None,
        }


def token_match(reference: list[int], tokens: list[int]) -> tuple[int, int, int | None]:
    """``(equal positions, compared positions, first divergence)``: positions up to the longer row count, so a
    row that stops early or runs on counts as divergent there; the divergence index is None for equal rows."""
    compared = max(len(reference), len(tokens))
    equal = sum(a == b for a, b in zip(reference, tokens, strict=False))
    first = next((i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b), None)
    if first is None and len(reference) != len(tokens):
        first = min(len(reference), len(tokens))
    return equal, compared, first


def attach_matches(records: list[Record], baseline: str | None) -> None:
    """Compare every record with the baseline's record of the same repeat, temperature, batch size and batch."""
    if baseline is None:
        return
    reference = {r.key: r for r in records if r.method == baseline}
    for record in records:
        ref = reference.get(record.key)
        if ref is not None:
            record.match = [token_match(a, b) for a, b in zip(ref.out.tokens, record.out.tokens, strict=True)]


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _throughput_by_repeat(records: list[Record]) -> dict[int, float]:
    tokens, time = defaultdict(int), defaultdict(float)
    for r in records:
        tokens[r.repeat] += r.out.num_tokens
        time[r.repeat] += r.wall_time_s
    return {k: tokens[k] / time[k] for k in tokens if time[k] > 0}


def _speedup(mine: dict[int, float], base: dict[int, float] | None, tps: float, base_tps: float | None):
    if not base or not base_tps:
        return None, None
    _, std = _mean_std([mine[k] / base[k] for k in mine if k in base])
    return tps / base_tps, std


def _acceptance(records: list[Record]) -> dict:
    outs = [r.out for r in records if r.counters]
    accepted = [a for o in outs for a in o.accepted]
    drafted = sum(d for o in outs for d in o.drafted)
    width = max((len(o.position_drafted) for o in outs), default=0)
    pos_acc, pos_dr = [0] * width, [0] * width
    for o in outs:
        for i, (a, d) in enumerate(zip(o.position_accepted, o.position_drafted, strict=True)):
            pos_acc[i] += a
            pos_dr[i] += d
    tokens = sum(o.num_tokens for o in outs)
    longest = sum(max(len(row) for row in o.tokens) for o in outs)
    proposers: dict[str, list[int]] = {}
    for o in outs:
        for name, tally in o.by_proposer.items():
            proposers[name] = [a + b for a, b in zip(proposers.get(name, [0, 0, 0]), tally, strict=True)]
    return {
        "acceptance_rate": sum(accepted) / drafted if drafted else None,
        "mean_accepted_length": statistics.fmean(a + 1 for a in accepted) if accepted else None,
        "accept_length_histogram": dict(sorted(Counter(a + 1 for a in accepted).items())),
        "position_acceptance": [a / d if d else None for a, d in zip(pos_acc, pos_dr, strict=True)],
        "decode_steps": sum(o.steps for o in outs) if outs else None,
        "tokens_per_step": tokens / steps if (steps := sum(o.steps for o in outs)) else None,
        "layers_per_token": sum(o.layers_run for o in outs) / tokens if outs and tokens else None,
        "layer_calls_per_token": sum(o.layer_calls for o in outs) / longest if outs and longest else None,
        "by_proposer": {
            name: {"accepted": a, "drafted": d, "rounds": n, "acceptance_rate": a / d if d else None}
            for name, (a, d, n) in proposers.items()
        }
        or None,
    }


def _matches(records: list[Record]) -> dict:
    rows = [m for r in records for m in r.match]
    if not rows:
        return {"match_rate": None, "identical_rows": None, "first_divergence_min": None}
    diverged = [m[2] for m in rows if m[2] is not None]
    return {
        "match_rate": sum(m[0] for m in rows) / max(1, sum(m[1] for m in rows)),
        "identical_rows": 1 - len(diverged) / len(rows),
        "first_divergence_min": min(diverged) if diverged else None,
        "first_divergence_mean": statistics.fmean(diverged) if diverged else None,
    }


def summarise(records: list[Record], baseline: str | None, hf_baseline: str | None) -> list[dict]:
    """One summary row per (temperature, batch size, method), in the order the methods first ran."""
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.temperature, r.batch_size, r.method)].append(r)
    rows = []
    for (temp, size, method), recs in groups.items():
        tokens, time = sum(r.out.num_tokens for r in recs), sum(r.wall_time_s for r in recs)
        by_repeat = _throughput_by_repeat(recs)
        mean, std = _mean_std(list(by_repeat.values()))
        tps = tokens / time if time > 0 else None
        row = {"method": method, "temperature": temp, "batch_size": size, "calls": len(recs)}
        row["weights"] = next((r.out.weights for r in recs if r.out.weights), None)
        row |= {"new_tokens": tokens, "wall_time_s": time, "tokens_per_s": tps}
        row |= {"ms_per_token": 1000 * time / tokens if tokens else None}
        row |= {"tokens_per_s_mean": mean, "tokens_per_s_std": std}
        for key, ref in (("baseline", baseline), ("hf", hf_baseline)):
            ref_recs = groups.get((temp, size, ref), [])
            ref_time = sum(r.wall_time_s for r in ref_recs)
            ref_tps = sum(r.out.num_tokens for r in ref_recs) / ref_time if ref_time > 0 else None
            value, spread = _speedup(by_repeat, _throughput_by_repeat(ref_recs), tps or 0.0, ref_tps)
            row |= {f"speedup_vs_{key}": value, f"speedup_vs_{key}_std": spread}
        ttfts = [1000 * r.ttft_s for r in recs if r.ttft_s is not None]
        tpots = [t for r in recs if (t := r.to_json()["tpot_ms"]) is not None]
        row |= {"ttft_ms": _mean_std(ttfts)[0], "ttft_ms_std": _mean_std(ttfts)[1]}
        row |= {"tpot_ms": _mean_std(tpots)[0]}
        row |= _acceptance(recs) | _matches(recs)
        memory = [r.peak_memory_mb for r in recs if r.peak_memory_mb is not None]
        row["peak_memory_mb"] = max(memory) if memory else None
        rows.append(row)
    return rows


def oracle_report(records: list[Record]) -> dict[str, dict]:
    """Per method with verifications, greedy calls only: the best draft length per verification
    (``DecodeOutput.oracle``: leading drafts equal to the verifier's argmax), its histogram and spread. Capped at
    the drafted length: measure with ``policy=constant`` and a large K (``decoder=[...,oracle]``)."""
    report = {}
    greedy = [r for r in records if r.temperature == 0 and r.counters]
    for method in dict.fromkeys(r.method for r in greedy):
        outs = [r.out for r in greedy if r.method == method]
        # Per row and verification; a row that drafted nothing (the budget's last token, an n-gram proposer
        # without a match) says nothing about the best draft length.
        pairs = [(v, d) for o in outs for v, d in zip(o.oracle, o.drafted, strict=True) if d > 0]
        if not pairs:
            continue
        values = [v for v, _ in pairs]
        ordered = sorted(values)
        mean, std = _mean_std(values)
        report[method] = {
            "verifications": len(values),
            "draft_cap": max(d for _, d in pairs),
            "capped_fraction": sum(v == d for v, d in pairs) / len(pairs),  # the best K may be larger there
            "histogram": dict(sorted(Counter(values).items())),
            "mean": mean,
            "std": std,
            "p10": ordered[math.floor(0.1 * (len(ordered) - 1))],
            "median": statistics.median(ordered),
            "p90": ordered[math.ceil(0.9 * (len(ordered) - 1))],
        }
    return report
