"""What the execution-engine micro-benchmark measures (``fastdecode/bench/engine.py``), every path side by
side in one process, interleaved (repeat -> T -> path -> component): the machine (streaming bandwidth, fp32
GEMM peak), forward cost vs T new tokens per component, per-layer-call overhead on a deep, narrow random Llama,
and autoregressive decoding against HF ``generate`` and the streaming roofline.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from fastdecode.bench.engine_job import EngineJob, decode_flags, path_options
from fastdecode.bench.measure import sync
from fastdecode.runtime.model import EarlyExitModel

log = logging.getLogger(__name__)


def _clock(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
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
            m.use_engine(path_options(path, m.device))
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
                    m.use_engine(path_options(path, m.device))
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
            m.use_engine(path_options(path, m.device))
            calls[path] = _range_call(fwd, num_layers)
            calls[path]()
        for _ in range(job.repeats):
            for path in paths:
                m.use_engine(path_options(path, m.device))
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
def autoregressive(m: EarlyExitModel, job: EngineJob, paths: list[str], bandwidth: float) -> dict:
    """Our ``autoregressive`` decoder per path against HF ``generate`` per batch size (tok/s, ratios, token
    equality), and the streaming roofline (``bandwidth`` GB/s over the weights read per token)."""
    gen = torch.Generator().manual_seed(job.seed + 1)
    out: dict[str, Any] = {}
    bytes_per_token = m.step_cost() * m.dtype.itemsize
    out["roofline_tok_s"] = bandwidth * 1e9 / bytes_per_token
    out["weights_mb_per_token"] = bytes_per_token / 1e6
    for batch in job.ar_batch_sizes:
        prompts = torch.randint(5, m.vocab_size, (batch, job.context), generator=gen).tolist()
        runners = _ar_runners(m, job, paths, prompts)
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
        out[f"batch{batch}"] = _ar_rows(seconds, tokens, batch * job.ar_new_tokens)
        if compile_s:
            out[f"batch{batch}_first_call_seconds"] = compile_s  # compile included
    m.use_engine(None)
    return out


def _ar_runners(
    m: EarlyExitModel, job: EngineJob, paths: list[str], prompts: list[list[int]]
) -> dict[str, Callable[[], object]]:
    """One call per path of our decoder on ``prompts``, and HF ``generate`` (greedy, EOS off)."""
    from fastdecode.decoding.config import DecodeConfig
    from fastdecode.registry import get_decoder

    decode = get_decoder("autoregressive")
    ids = torch.tensor(prompts, device=m.device)
    runners: dict[str, Callable[[], object]] = {}
    for path in paths:
        cfg = DecodeConfig(max_new_tokens=job.ar_new_tokens, **decode_flags(path))
        runners[path] = lambda cfg=cfg: decode(m, prompts, cfg)

    def hf_generate() -> torch.Tensor:
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
    return runners


def _ar_rows(seconds: dict[str, list[float]], tokens: dict[str, list], new_tokens: int) -> dict[str, dict]:
    """Per runner: tok/s (median, min, max) of ``new_tokens`` per call, ratios to HF ``generate`` and
    whether its tokens equal HF's."""
    hf_tok_s = new_tokens / statistics.median(seconds["hf_generate"])
    hf_best = new_tokens / min(seconds["hf_generate"])
    rows = {}
    for name, s in seconds.items():
        tok_s = [new_tokens / x for x in s]
        rows[name] = {
            "tok_s": statistics.median(tok_s),
            "min": min(tok_s),
            "max": max(tok_s),
            "vs_hf_generate": statistics.median(tok_s) / hf_tok_s,
            "vs_hf_generate_best": max(tok_s) / hf_best,  # best runs (least disturbed) of each
            "tokens_equal_hf_generate": tokens[name] == tokens["hf_generate"],
        }
    return rows
