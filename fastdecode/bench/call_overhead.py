"""What ``FastDecoder.generate`` costs beyond its decoder (``eval/call_overhead.py``): (a) the public call
``generate(ids, max_new_tokens=N, method=M)`` against (b) the registered decoder called directly on the same
``EarlyExitModel`` with the config (a) builds, same prompt ids, interleaved in alternating order, per token
count (``paired``); the API's own work, timed with the decoder replaced by its recorded output, free of the
model's noise, as a share of (b)'s longest answer (``own_work``); a cProfile of where it goes.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastdecode import api
from fastdecode.api import FastDecoder, from_pretrained
from fastdecode.config import ConfigError
from fastdecode.decoding.common import check, configure_engine
from fastdecode.decoding.config import DecodeOutput
from fastdecode.registry import decoder_names, get_decoder
from fastdecode.runtime.machine import machine_label

# prompts whose greedy answers run past 48 tokens on SmolLM2-135M-Instruct (an answer cut by EOS is reported)
PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "Describe a walk through a busy market in a city you like.",
)


@dataclass
class Paired:
    """One token count: per call (the mean over the prompts), (a) and (b) in ms, each repeat's pair."""

    max_new_tokens: int
    tokens: float  # new tokens per call, mean over the prompts (EOS may end an answer early)
    api_ms: list[float]
    direct_ms: list[float]

    @property
    def overhead_ms(self) -> float:
        """Median over repeats of (a) - (b): what the public call adds."""
        return statistics.median(a - b for a, b in zip(self.api_ms, self.direct_ms, strict=True))

    def summary(self) -> dict:
        return {
            "max_new_tokens": self.max_new_tokens,
            "rounds": len(self.api_ms),
            "tokens": self.tokens,
            "api_ms": {"min": min(self.api_ms), "median": statistics.median(self.api_ms)},
            "direct_ms": {"min": min(self.direct_ms), "median": statistics.median(self.direct_ms)},
            "overhead_ms": self.overhead_ms,
            "ratio_of_medians": statistics.median(self.api_ms) / statistics.median(self.direct_ms),
        }


def prompt_ids_of(fd: FastDecoder, text: str) -> list[int]:
    """``text`` as the ids ``generate`` would decode: through the chat template when the tokenizer has one."""
    tokenizer = fd.tokenizer
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(text).input_ids)


def paired(
    fd: FastDecoder, prompts: Sequence[list[int]], max_new_tokens: int, method: str, repeats: int
) -> Paired:
    """(a) and (b) on every prompt, ``repeats`` times after one untimed round, their order alternating by
    repeat; (b) runs the decoder with the config (a) builds for these options, built once, outside the timing.
    Both must emit the same tokens (the same work), else a ``RuntimeError``."""
    cfg = fd.config(method, max_new_tokens=max_new_tokens)
    decoder = get_decoder(method)

    def api(ids: list[int]) -> list[int]:
        return fd.generate(ids, max_new_tokens=max_new_tokens, method=method).ids[0]

    def direct(ids: list[int]) -> list[int]:
        return decoder(fd.m, [ids], cfg).tokens[0]

    api_ms, direct_ms, tokens = [], [], []
    for repeat in range(repeats + 1):
        totals = {api: 0.0, direct: 0.0}
        for ids in prompts:
            order = (api, direct) if repeat % 2 else (direct, api)
            emitted = []
            for call in order:
                start = time.perf_counter()
                emitted.append(call(ids))
                totals[call] += time.perf_counter() - start
            if emitted[0] != emitted[1]:
                raise RuntimeError(f"generate() and the {method} decoder emitted different tokens: {emitted}")
            tokens.append(len(emitted[0]))
        if repeat:  # the first round warms up
            api_ms.append(totals[api] * 1e3 / len(prompts))
            direct_ms.append(totals[direct] * 1e3 / len(prompts))
    return Paired(max_new_tokens, statistics.mean(tokens), api_ms, direct_ms)


@contextlib.contextmanager
def recorded_decoder(out: DecodeOutput) -> Iterator[None]:
    """Inside: ``generate``'s decoder returns ``out`` at once (looked up as before, so an unknown name is still
    refused): what remains of a call is the API's own work."""
    real = api.get_decoder

    def lookup(name: str) -> Callable:
        real(name)
        return lambda m, prompts, cfg, draft=None: out

    api.get_decoder = lookup
    try:
        yield
    finally:
        api.get_decoder = real


def own_work(fd: FastDecoder, ids: list[int], method: str, calls: int) -> dict:
    """Microseconds per call (min, median of ``calls``, each timed alone): ``generate(ids, max_new_tokens=1)``
    with its decoder replaced by the output it gave (``recorded_decoder``): the API's own work, free of the
    model's noise; and the decoder's own set-up, which (b) pays too (``check``, ``configure_engine``)."""
    out = get_decoder(method)(fd.m, [ids], fd.config(method, max_new_tokens=1))
    cfg = fd.config(method, max_new_tokens=1)

    def timed_us(call: Callable[[], Any]) -> dict:
        call()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e6)
        return {"min": min(times), "median": statistics.median(times)}

    with recorded_decoder(out):
        public = timed_us(lambda: fd.generate(ids, max_new_tokens=1, method=method))
    return {
        "generate": public,
        "check": timed_us(lambda: check(cfg, fd.m, [ids])),
        "configure_engine": timed_us(lambda: configure_engine(fd.m, cfg)),
    }


def _key(fn: Callable) -> tuple:
    """``fn``'s key in ``pstats`` (its code's file, first line and name)."""
    code = fn.__code__
    return code.co_filename, code.co_firstlineno, code.co_name


def profile_outside(fd: FastDecoder, ids: list[int], method: str, calls: int) -> dict:
    """cProfile of ``calls`` public calls at one new token: per call (us, profiler overhead included), the whole
    call, the decoder inside it, what ``generate`` ran besides the decoder (its direct callees and its own
    lines), and the decoder's own set-up (``check``, ``configure_engine``), which (b) pays too."""
    fd.generate(ids, max_new_tokens=1, method=method)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fd.generate(ids, max_new_tokens=1, method=method)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # key -> (calls, primitive calls, own time, cumulative, callers)
    whole = _key(FastDecoder.generate)  # the public call: the model's lock around the body
    body = _key(FastDecoder.generate.__wrapped__)
    decoder = _key(get_decoder(method))  # the registry's wrapper (its locks) around the decoder

    def per_call(seconds: float) -> float:
        return seconds * 1e6 / calls

    outside = {"generate's own lines": per_call(stats[body][2])}
    for key, (_, _, _, _, callers) in stats.items():
        if body in callers and key != decoder:
            outside[f"{key[2]} ({key[0].rsplit('/', 1)[-1]}:{key[1]})"] = per_call(callers[body][3])
    setup = {
        fn.__name__: per_call(stats[_key(fn)][3]) for fn in (check, configure_engine) if _key(fn) in stats
    }
    return {
        "call_us": per_call(stats[whole][3]),
        "decoder_us": per_call(stats[decoder][3]),
        "outside_us": dict(sorted(outside.items(), key=lambda item: -item[1])),
        "decoder_setup_us": setup,
    }


def run(
    model: str,
    *,
    tokens: Sequence[int] = (1, 48),
    method: str = "autoregressive",
    repeats: int = 20,
    threads: int = 1,
    profile_calls: int = 200,
) -> dict:
    """Load ``model`` and measure every token count of ``tokens`` (the largest is the answer the overhead is a
    share of), ``repeats`` rounds at the largest and up to 8x as many at the others (in proportion to the
    token counts); the report as a dict (``report`` prints it)."""
    if method not in decoder_names():  # ``auto`` runs the plan's candidate: no one decoder to compare with
        raise ConfigError(f"--method {method!r}: give a decoder name ({', '.join(decoder_names())}).")
    if not tokens or min(tokens) < 1 or repeats < 1:
        raise ConfigError(f"--tokens {list(tokens)} and --repeats {repeats}: every count must be >= 1.")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fd = from_pretrained(model)
        prompts = [prompt_ids_of(fd, text) for text in PROMPTS]
        longest = max(tokens)  # shorter calls are noisier per call and cheaper: more rounds, at most 8x
        results = [paired(fd, prompts, n, method, repeats * min(8, longest // n)) for n in sorted(tokens)]
        own = own_work(fd, prompts[0], method, 10 * profile_calls)
        profile = profile_outside(fd, prompts[0], method, profile_calls)
        machine = machine_label(fd.m.device, threads)
    finally:
        torch.set_num_threads(previous)
    answer_ms = statistics.median(results[-1].direct_ms)
    return {
        "model": model,
        "method": method,
        "machine": machine,
        "repeats": repeats,
        "prompts": len(prompts),
        "results": [r.summary() | {"api_ms_all": r.api_ms, "direct_ms_all": r.direct_ms} for r in results],
        "own_work_us": own,
        "answer_ms": answer_ms,
        "overhead_share": own["generate"]["median"] / 1e3 / answer_ms,
        "paired_share": results[0].overhead_ms / answer_ms,
        "profile": profile,
    }


def report(result: dict) -> str:
    """The measurement as text: per token count (a), (b), their paired difference; the API's own work and its
    share of the longest answer; the decoder's set-up; the profile of the work outside the decoder."""
    longest = result["results"][-1]
    lines = [
        f"{result['model']}, method={result['method']}, {result['machine']}, {result['prompts']} prompts, "
        "interleaved rounds (a)(b)/(b)(a); ms per call",
        "max_new_tokens  rounds  tokens  (a) generate min/med  (b) decoder min/med  (a)-(b) median  (a)/(b)",
    ]
    for r in result["results"]:
        a, b = r["api_ms"], r["direct_ms"]
        lines.append(
            f"{r['max_new_tokens']:>14}  {r['rounds']:>6}  {r['tokens']:>6.1f}  {a['min']:>9.2f} / {a['median']:<9.2f}"
            f"  {b['min']:>8.2f} / {b['median']:<8.2f}  {r['overhead_ms']:>14.3f}  {r['ratio_of_medians']:.4f}"
        )
    own = result["own_work_us"]
    lines += [
        f"the API's own work per call (generate, its decoder replaced by its recorded output, us min/median): "
        f"{own['generate']['min']:.1f} / {own['generate']['median']:.1f} = {100 * result['overhead_share']:.3f}% "
        f"of a {longest['max_new_tokens']}-token answer ({result['answer_ms']:.1f} ms, the decoder alone); "
        f"paired (a)-(b) at {result['results'][0]['max_new_tokens']} token(s): "
        f"{100 * result['paired_share']:.3f}%",
        "the decoder's own set-up per call, paid by (b) too (us min/median): "
        + ", ".join(
            f"{name} {own[name]['min']:.1f} / {own[name]['median']:.1f}"
            for name in ("check", "configure_engine")
        ),
    ]
    profile = result["profile"]
    lines.append(
        f"cProfile at 1 new token (us per call, profiler overhead included): generate {profile['call_us']:.0f}, "
        f"its decoder {profile['decoder_us']:.0f}; outside the decoder:"
    )
    lines += [f"  {us:9.1f}  {name}" for name, us in profile["outside_us"].items() if us >= 0.5]
    lines.append("inside the decoder:")
    lines += [f"  {us:9.1f}  {name}" for name, us in profile["decoder_setup_us"].items()]
    return "\n".join(lines)
