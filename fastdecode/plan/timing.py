"""Timing on a shared machine: the least disturbed of interleaved rounds, the lower envelope over the number
of new tokens T, and where a forward runs cheaper as a larger T (``pad_lengths``). Used by the cost model
(``fastdecode/plan/cost.py``) and the drafters' cost probes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

# a verification runs as a larger T (``pad_lengths``) only when that measured this much cheaper
PAD_MARGIN = 0.1


Timer = Callable[[tuple, Callable[[], Any], torch.device], float]


def timed(name: tuple, fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn()`` takes (the device synchronised before both clock reads); ``name`` says which probe
    (``measure_costs`` takes another timer of this signature in tests)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def lower_envelope(seconds: Sequence[float]) -> list[float]:
    """Times per increasing T lowered to the largest non-decreasing sequence below them: each T takes the
    least time measured at T or any larger T. Timing noise only ever adds time, so a probe slower than a
    larger T's was disturbed (a busy machine), or T runs slower than the larger T for real, and the
    verification pads to it (``pad_lengths``): either way its cost is at most the larger T's. (A running
    maximum would copy one disturbed small-T probe to every larger T, making verification look free.)"""
    out, low = [], float("inf")
    for value in reversed(seconds):
        low = min(low, value)
        out.append(low)
    return out[::-1]


def pad_lengths(
    tokens: Sequence[int], seconds: Sequence[float], margin: float = PAD_MARGIN
) -> tuple[int, ...]:
    """Per probed T (increasing ``tokens``, a forward's least time ``seconds``): the larger probed T to run
    instead when that was measured more than ``margin`` cheaper (the cheapest such), else T itself. Why: the
    lower envelope prices T at the least time of any T' >= T; padding makes that price true. On some CPUs
    oneDNN's kernels for two rows run slower than for three to five (measured: a 2-token forward of
    SmolLM2-135M at 1.4-1.5 one-token forwards, 3 to 5 tokens at 1.1-1.2)."""
    out = []
    for i, t in enumerate(tokens):
        j = min(range(i, len(tokens)), key=lambda n: (seconds[n], n))
        out.append(tokens[j] if seconds[j] < seconds[i] * (1 - margin) else t)
    return tuple(out)


def interleaved_minima(probes: dict, device: torch.device, repeats: int, timer: Timer) -> dict:
    """The least disturbed of ``repeats`` interleaved rounds of every probe (after one untimed round)."""
    times: dict = {name: [] for name in probes}
    for round_ in range(repeats + 1):
        for name, probe in probes.items():
            seconds = timer(name, probe, device)
            if round_:
                times[name].append(seconds)
    return {name: min(found) for name, found in times.items()}
