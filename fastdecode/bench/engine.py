"""The execution-engine micro-benchmark behind ``eval/engine.py`` (``configs/engine.yaml``).

What it measures, every path side by side in one process, interleaved (repeat -> T -> path -> component), the
median and spread over ``repeats`` rounds, each round the mean of ``calls`` calls:

- machine: streaming memory bandwidth (a sum over a ``bandwidth_mb`` tensor) and the fp32 GEMM peak;
- forward cost vs T new tokens (``steps``) over a cache of ``context`` tokens, for the full model (embedding,
  layers, head), layers ``[0, E)``, layers ``[E, L)``, the full head and a head of ``subset_rows`` rows (a
  draft vocabulary), per path (``hf``: the HF modules; ``engine``: the default engine; ``static``: with the
  static cache; ``compile``: compiled layer ranges on the static cache, compile time reported apart);
- per-layer-call overhead: one layer call at T = 1 on a deep, narrow random Llama (``overhead_model``), where
  the matrix products are negligible and what is left is framework time;
- autoregressive decoding: our ``autoregressive`` decoder per path against HF ``generate`` (greedy, batch
  ``ar_batch_sizes``, ``ar_new_tokens`` tokens after a ``context``-token prompt, EOS off), and the streaming
  roofline (bytes of weights read per token / measured bandwidth);
- all of it per thread count (``threads``); ``bf16: true`` adds the autoregressive comparison in bf16
  (reported, not targeted: oneDNN's packed bf16 path needs AVX-512 or AVX-NE-CONVERT).

Writes ``engine.json`` and ``engine.md`` into ``output_dir``.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fastdecode.config import ConfigError, ModelConfig, to_dataclass

log = logging.getLogger(__name__)
PATHS = ("hf", "engine", "static", "compile")
COMPONENTS = ("model", "layers_lo", "layers_hi", "head", "head_subset")


@dataclasses.dataclass
class EngineJob:
    model: ModelConfig
    exit_layer: int = 8
    context: int = 300
    steps: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 3, 5, 9, 17])
    components: list[str] = dataclasses.field(default_factory=lambda: list(COMPONENTS))
    paths: list[str] = dataclasses.field(default_factory=lambda: ["hf", "engine"])
    ar_paths: list[str] = dataclasses.field(default_factory=lambda: ["hf", "engine"])
    subset_rows: int = 8192
    threads: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    repeats: int = 5
    calls: int = 3
    overhead: bool = True
    overhead_model: dict = dataclasses.field(
        default_factory=lambda: {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 30}
    )
    ar: bool = True
    ar_batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [1])
    ar_new_tokens: int = 32
    ar_repeats: int = 3
    bf16: bool = True
    bandwidth_mb: int = 1024
    seed: int = 0
    output_dir: str = "outputs/engine"

    def __post_init__(self) -> None:
        for path in self.paths + self.ar_paths:
            if path not in PATHS:
                raise ConfigError(f"paths / ar_paths: unknown path '{path}'; choices: {', '.join(PATHS)}.")
        for comp in self.components:
            if comp not in COMPONENTS:
                raise ConfigError(f"engine.components: unknown '{comp}'; choices: {', '.join(COMPONENTS)}.")
        if "hf" not in self.paths:
            raise ConfigError("engine.paths must include 'hf' (the reference every ratio refers to).")


def _options(path: str, device: torch.device):
    """The engine of a path: lean layers always (the point of the comparison, also on CUDA, where they are
    not the default), packed kernels where they are the default (CPU)."""
    from fastdecode.engine import default_options

    if path == "hf":
        return None
    return default_options(
        device, fast_layers=True, static_cache=path in ("static", "compile"), compile=path == "compile"
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls


def _summary(samples: list[float]) -> dict:
    ms = [s * 1e3 for s in samples]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


# --------------------------------------------------------------------------------------------------------
# The machine
def machine(device: torch.device, bandwidth_mb: int) -> dict:
    """Streaming bandwidth (GB/s, best of 5 sums over a ``bandwidth_mb`` tensor) and fp32 GEMM GFLOP/s."""
    big = torch.ones(bandwidth_mb * 2**20 // 4, device=device)
    big.sum()
    best = min(_clock(big.sum, 1, device) for _ in range(5))
    bandwidth = big.numel() * 4 / best / 1e9
    del big
    a = torch.randn(1024, 1024, device=device)
    a @ a
    gemm = min(_clock(lambda: a @ a, 1, device) for _ in range(5))
    return {"bandwidth_gb_s": bandwidth, "gemm_gflop_s": 2 * 1024**3 / gemm / 1e9}


# --------------------------------------------------------------------------------------------------------
# Forward cost vs T
class Forward:
    """Forwards of T new tokens over a cache of ``context`` tokens; every call rolls the cache back."""

    def __init__(self, m, context: int, exit_layer: int, subset_rows: int, seed: int) -> None:
        self.m, self.exit_layer = m, exit_layer
        gen = torch.Generator().manual_seed(seed)
        self.prompt = torch.randint(0, m.vocab_size, (1, context), generator=gen).to(m.device)
        self.subset = torch.arange(min(subset_rows, m.vocab_size), device=m.device)
        self.caches: dict[bool, Any] = {}

    def cache(self):
        static = self.m.engine is not None and self.m.engine.options.static_cache
        if static not in self.caches:
            cache = self.m.new_cache(1, self.prompt.shape[1] + 64)
            self.m.forward(self.prompt, cache=cache)
            self.caches[static] = cache
        return self.caches[static]

    def component(self, name: str, steps: int) -> Callable[[], object]:
        m, exit_layer = self.m, self.exit_layer
        cache = self.cache()
        past = cache.lengths[0]
        ids = self.prompt[:, :steps]
        pos = torch.arange(past, past + steps, device=m.device)[None]
        valid = torch.ones(1, steps, dtype=torch.bool, device=m.device)
        hidden = m.embed(ids, pos)
        upper = m.run_layers(hidden, 0, exit_layer, pos, cache=cache)
        cache.crop(past)

        def layers(start: int, end: int, h: torch.Tensor) -> torch.Tensor:
            cache.reserve(valid, past, pos)
            out = m.run_layers(h, start, end, pos, cache=cache)
            cache.crop(past)
            return out

        if name == "model":
            return lambda: m.exit_logits(layers(0, m.num_layers, m.embed(ids, pos))[:, -steps:])
        if name == "layers_lo":
            return lambda: layers(0, exit_layer, hidden)
        if name == "layers_hi":  # verification: layers >= E on the drafter's hidden states
            return lambda: layers(exit_layer, m.num_layers, upper)
        if name == "head":
            return lambda: m.exit_logits(upper)
        return lambda: m.exit_logits_subset(upper, self.subset)


def forward_costs(m, job: EngineJob) -> dict:
    """``{path: {component: {T: summary}}}`` plus ratios; compile time per path when compiling."""
    fwd = Forward(m, job.context, job.exit_layer, job.subset_rows, job.seed)
    samples: dict[tuple, list[float]] = {}
    compile_s: dict[str, float] = {}
    with torch.inference_mode():
        calls = {}
        for path in job.paths:  # build engines, caches and closures; warm up (and compile) outside the clock
            m.use_engine(_options(path, m.device))
            for comp in job.components:
                for steps in job.steps:
                    fn = calls[(path, comp, steps)] = fwd.component(comp, steps)
                    fn()
            if m.engine is not None and m.engine.compile_seconds:
                compile_s[path] = sum(m.engine.compile_seconds.values())
        log.info("forward costs: engines built and warm; %d rounds", job.repeats)
        for _ in range(job.repeats):
            for steps in job.steps:
                for path in job.paths:
                    m.use_engine(_options(path, m.device))
                    for comp in job.components:
                        t = _clock(calls[(path, comp, steps)], job.calls, m.device)
                        samples.setdefault((path, comp, steps), []).append(t)
    m.use_engine(None)
    out: dict[str, Any] = {"compile_seconds": compile_s, "paths": {}}
    for path in job.paths:
        table = out["paths"][path] = {}
        for comp in job.components:
            row = table[comp] = {}
            first = job.steps[0]
            base_self, base_hf = samples[(path, comp, first)], samples[("hf", comp, first)]
            for steps in job.steps:
                mine = samples[(path, comp, steps)]
                s = _summary(mine)
                # ratios of medians, and of minima (the least disturbed rounds on a shared machine)
                s["vs_own_T1"] = statistics.median(mine) / statistics.median(base_self)
                s["vs_hf_T1"] = statistics.median(mine) / statistics.median(base_hf)
                s["vs_own_T1_min"] = min(mine) / min(base_self)
                s["vs_hf_T1_min"] = min(mine) / min(base_hf)
                row[str(steps)] = s
    return out


# --------------------------------------------------------------------------------------------------------
# Per-layer-call overhead
def layer_overhead(job: EngineJob, paths: list[str]) -> dict:
    """Time of one layer call at T = 1 (300-token cache) on a deep, narrow random Llama, per path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastdecode.model import EarlyExitModel

    geometry = {"vocab_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2} | job.overhead_model
    config = LlamaConfig(max_position_embeddings=job.context + 64, **geometry)
    torch.manual_seed(job.seed)
    m = EarlyExitModel(LlamaForCausalLM(config).eval())
    num_layers = m.num_layers
    fwd = Forward(m, job.context, 1, 16, job.seed)
    samples: dict[str, list[float]] = {}
    with torch.inference_mode():
        calls = {}
        for path in paths:
            m.use_engine(_options(path, m.device))
            calls[path] = _range_call(fwd, num_layers)
            calls[path]()
        for _ in range(job.repeats):
            for path in paths:
                m.use_engine(_options(path, m.device))
                samples.setdefault(path, []).append(_clock(calls[path], job.calls * 3, m.device) / num_layers)
    out = {"model": geometry, "us_per_layer_call": {}}
    for path in paths:
        us = [s * 1e6 for s in samples[path]]
        out["us_per_layer_call"][path] = {"median": statistics.median(us), "min": min(us), "max": max(us)}
    out["ratio_vs_hf"] = {
        p: out["us_per_layer_call"][p]["median"] / out["us_per_layer_call"]["hf"]["median"] for p in paths
    }
    return out


def _range_call(fwd: Forward, num_layers: int) -> Callable[[], object]:
    m = fwd.m
    cache = fwd.cache()
    past = cache.lengths[0]
    pos = torch.tensor([[past]], device=m.device)
    valid = torch.ones(1, 1, dtype=torch.bool, device=m.device)
    hidden = m.embed(fwd.prompt[:, :1], pos)

    def run():
        cache.reserve(valid, past, pos)
        out = m.run_layers(hidden, 0, num_layers, pos, cache=cache)
        cache.crop(past)
        return out

    return run


# --------------------------------------------------------------------------------------------------------
# Autoregressive decoding vs HF generate vs the roofline
def autoregressive(m, job: EngineJob, paths: list[str], bandwidth: float) -> dict:
    from fastdecode.decoding import DecodeConfig, get_decoder

    decode = get_decoder("autoregressive")
    gen = torch.Generator().manual_seed(job.seed + 1)
    out: dict[str, Any] = {}
    bytes_per_token = m.step_cost() * m.dtype.itemsize
    out["roofline_tok_s"] = bandwidth * 1e9 / bytes_per_token
    out["weights_mb_per_token"] = bytes_per_token / 1e6
    for batch in job.ar_batch_sizes:
        prompts = torch.randint(5, m.vocab_size, (batch, job.context), generator=gen).tolist()
        ids = torch.tensor(prompts, device=m.device)
        runners: dict[str, Callable[[], object]] = {}
        for path in paths:
            cfg = DecodeConfig(max_new_tokens=job.ar_new_tokens, **_decode_flags(path))
            runners[path] = lambda cfg=cfg, prompts=prompts: decode(m, prompts, cfg)

        def hf_generate(ids=ids):
            with torch.inference_mode():
                return m.hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=job.ar_new_tokens,
                    min_new_tokens=job.ar_new_tokens,
                    pad_token_id=0,
                )

        runners["hf_generate"] = hf_generate
        tokens, compile_s = {}, {}
        for name, fn in runners.items():  # warm-up (compiles), and outputs for the equality check
            began = time.perf_counter()
            result = fn()
            if name == "compile":
                compile_s[name] = time.perf_counter() - began
            tokens[name] = result.tokens if hasattr(result, "tokens") else result[:, job.context :].tolist()
        seconds: dict[str, list[float]] = {}
        log.info("autoregressive batch %d: warm; %d rounds", batch, job.ar_repeats)
        for _ in range(job.ar_repeats):
            for name, fn in runners.items():
                seconds.setdefault(name, []).append(_clock(fn, 1, m.device))
        row = out[f"batch{batch}"] = {}
        if compile_s:
            out[f"batch{batch}_first_call_seconds"] = compile_s  # compile included
        hf_tok_s = batch * job.ar_new_tokens / statistics.median(seconds["hf_generate"])
        hf_best = batch * job.ar_new_tokens / min(seconds["hf_generate"])
        for name, s in seconds.items():
            tok_s = [batch * job.ar_new_tokens / x for x in s]
            row[name] = {
                "tok_s": statistics.median(tok_s),
                "min": min(tok_s),
                "max": max(tok_s),
                "vs_hf_generate": statistics.median(tok_s) / hf_tok_s,
                "vs_hf_generate_best": max(tok_s) / hf_best,  # best runs (least disturbed) of each
                "tokens_equal_hf_generate": tokens[name] == tokens["hf_generate"],
            }
    m.use_engine(None)
    return out


def _decode_flags(path: str) -> dict:
    if path == "hf":
        return {"fast_layers": False, "fast_linear": False}
    return {"fast_layers": True, "static_cache": path in ("static", "compile"), "compile": path == "compile"}


# --------------------------------------------------------------------------------------------------------
def run(cfg: Any) -> dict:
    """Run the benchmark of ``configs/engine.yaml``; write ``engine.json`` and ``engine.md``; return it."""
    from fastdecode.bench.report import cpu_name, git_state
    from fastdecode.io import atomic_write_json, atomic_write_text, check_writable
    from fastdecode.loading import load_model
    from fastdecode.model import EarlyExitModel

    job = to_dataclass(EngineJob, cfg, "")
    check_writable(job.output_dir)  # before the model loads
    model, _ = load_model(job.model)
    m = EarlyExitModel(model)
    if not 1 <= job.exit_layer < m.num_layers:
        raise ConfigError(f"exit_layer={job.exit_layer}: use 1 <= exit_layer <= {m.num_layers - 1}.")
    import transformers

    result: dict[str, Any] = {
        "model": job.model.name,
        "dtype": str(m.dtype),
        "device": str(m.device),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git": git_state(),
        "job": dataclasses.asdict(job),
        "threads": {},
    }
    saved_threads = torch.get_num_threads()
    try:
        for threads in job.threads:
            torch.set_num_threads(threads)
            log.info("%d thread(s)", threads)
            entry = result["threads"][str(threads)] = {"machine": machine(m.device, job.bandwidth_mb)}
            entry["forward"] = forward_costs(m, job)
            engine = m.use_engine(_options("engine", m.device))
            entry["engine_build_seconds"] = engine.build_seconds if engine else None
            entry["plans"] = engine.plans if engine else {}
            # seconds per sweep of each kernel at each probed M: the measurement behind the plans
            entry["calibration"] = engine.timings if engine else {}
            m.use_engine(None)
            if job.overhead:
                entry["layer_overhead"] = layer_overhead(job, [p for p in job.paths if p != "compile"])
            if job.ar:
                bandwidth = entry["machine"]["bandwidth_gb_s"]
                entry["autoregressive"] = autoregressive(m, job, job.ar_paths, bandwidth)
                if job.bf16 and m.device.type == "cpu":
                    low, _ = load_model(dataclasses.replace(job.model, dtype="bfloat16"))
                    entry["autoregressive_bf16"] = autoregressive(
                        EarlyExitModel(low),
                        job,
                        [p for p in job.ar_paths if p in ("hf", "engine")],
                        bandwidth,
                    )
                    del low
    finally:
        torch.set_num_threads(saved_threads)
    out = Path(job.output_dir)
    atomic_write_json(out / "engine.json", result)
    atomic_write_text(out / "engine.md", to_markdown(result))
    return result


# --------------------------------------------------------------------------------------------------------
def to_markdown(result: dict) -> str:
    job = result["job"]
    lines = [
        f"# Execution engine: {result['model']} ({result['dtype']}, {result['device']}, {result['cpu']})",
        "",
        f"torch {result['torch']}, transformers {result['transformers']}, git {result['git'].get('commit')}"
        f"{' (dirty)' if result['git'].get('dirty') else ''}; cache of {job['context']} tokens, E = "
        f"{job['exit_layer']}, {job['repeats']} interleaved rounds of {job['calls']} calls (median, [min-max]).",
    ]
    for threads, entry in result["threads"].items():
        mach = entry["machine"]
        lines += [
            "",
            f"## {threads} thread(s): bandwidth {mach['bandwidth_gb_s']:.1f} GB/s, fp32 GEMM "
            f"{mach['gemm_gflop_s']:.0f} GFLOP/s",
            "",
        ]
        fwd = entry["forward"]
        steps = job["steps"]
        header = "| component | path | " + " | ".join(f"T={t}" for t in steps) + " |"
        lines += [
            "Forward cost: median ms, and (ratio to the same path at T=1 / to HF at T=1), ratios of medians;"
            " below each row the ratios of the minima",
            "",
            header,
            "|" + " --- |" * (len(steps) + 2),
        ]
        for comp in job["components"]:
            for path, table in fwd["paths"].items():
                cells = []
                for t in steps:
                    s = table[comp][str(t)]
                    cells.append(f"{s['median_ms']:.2f} ({s['vs_own_T1']:.2f}x / {s['vs_hf_T1']:.2f}x)")
                lines.append(f"| {comp} | {path} | " + " | ".join(cells) + " |")
                mins = [
                    f"min {table[comp][str(t)]['min_ms']:.2f} ({table[comp][str(t)]['vs_own_T1_min']:.2f}x / "
                    f"{table[comp][str(t)]['vs_hf_T1_min']:.2f}x)"
                    for t in steps
                ]
                lines.append("| | | " + " | ".join(mins) + " |")
        if fwd["compile_seconds"]:
            lines += ["", f"Compile time (all graphs): {fwd['compile_seconds']}"]
        over = entry.get("layer_overhead")
        if over:
            lines += ["", "Per-layer-call overhead (narrow model, T=1): "]
            lines.append(
                ", ".join(
                    f"{p} {v['median']:.0f} us [{v['min']:.0f}-{v['max']:.0f}] ({over['ratio_vs_hf'][p]:.2f}x)"
                    for p, v in over["us_per_layer_call"].items()
                )
            )
        for key, label in (("autoregressive", "fp32"), ("autoregressive_bf16", "bf16")):
            if key not in entry:
                continue
            ar = entry[key]
            lines += [
                "",
                f"Autoregressive ({label}, {job['ar_new_tokens']} new tokens): roofline "
                f"{ar['roofline_tok_s']:.1f} tok/s ({ar['weights_mb_per_token']:.0f} MB of weights per token)",
                "",
                "| batch | method | tok/s [min-max] | vs HF generate (medians / best runs) | of roofline | tokens = HF |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
            for batch_key, row in ar.items():
                if not batch_key.startswith("batch") or batch_key.endswith("seconds"):
                    continue
                for name, r in row.items():
                    lines.append(
                        f"| {batch_key[5:]} | {name} | {r['tok_s']:.1f} [{r['min']:.1f}-{r['max']:.1f}] | "
                        f"{r['vs_hf_generate']:.2f}x / {r['vs_hf_generate_best']:.2f}x | "
                        f"{r['tok_s'] / ar['roofline_tok_s']:.2f} | "
                        f"{'yes' if r['tokens_equal_hf_generate'] else 'no'} |"
                    )
                first = ar.get(f"{batch_key}_first_call_seconds")
                if first:
                    lines.append(
                        f"| {batch_key[5:]} | first compiled call (compile included) | {first} s | | | |"
                    )
        plans = entry.get("plans") or {}
        if plans:
            lines += [
                "",
                "Kernel plans (M = 1, 2, ...): "
                + "; ".join(f"{k}: {'/'.join(v[:17])}" for k, v in plans.items()),
            ]
    return "\n".join(lines) + "\n"
