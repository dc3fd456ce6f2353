"""What a LayerSkip training step costs against a plain fine-tuning step, same model and batch
(``fastdecode-train-cost`` / ``python eval/train_cost.py``, ``fastdecode_cli/train_cost.py``).

Time: all kinds of step run in one process, interleaved after warm-up, so machine drift cancels; the ratio
of medians is reported. Peak memory: each kind runs in its own subprocess (CPU: peak RSS sampled every 2 ms
during the steps, above the RSS after loading the model and building the optimiser; CUDA:
``max_memory_allocated`` above the allocation before the steps).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastdecode.config import ModelConfig, load_group
from fastdecode.runtime.loading import load_model
from fastdecode.runtime.machine import machine_label

VARIANTS = {  # LayerSkip step kinds: recipe.* overrides of configs/recipe/layerskip.yaml
    # The recipe's default: strided exits over every layer (every 4th layer a step), exp dropout 0.1.
    "layerskip": {},
    # The tuned CPU experiment: three exits, self-distillation.
    "layerskip-3exits-distill": {
        "early_exit_loss": {"layers": "9,18,24", "curriculum": "none", "distill": 1.0},
    },
    # Strided exits, each non-final exit scored on a random quarter of the tokens (unbiased estimate).
    "layerskip-fraction0.25": {"early_exit_loss": {"token_fraction": 0.25}},
}


@dataclass(frozen=True)
class StepShape:
    """What every kind of step runs on: ``configs/model/<model>.yaml``, ``batch`` random sequences of ``seq``
    tokens, ``steps`` measured steps."""

    model: str = "smollm2-135m"
    batch: int = 4
    seq: int = 256
    steps: int = 6


def _step_fn(kind: str, model, batch: dict, total_steps: int) -> Callable[[int], float]:
    """A closure running one forward+backward+optimiser step of ``kind`` (plain or a LayerSkip variant)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    if kind == "plain":

        def forward(step: int) -> torch.Tensor:
            return model(**batch).loss
    else:
        from fastdecode.config import to_dataclass
        from layerskip_train.config import LayerSkipConfig
        from layerskip_train.module import EarlyExitLM

        cfg = to_dataclass(LayerSkipConfig, VARIANTS[kind], "recipe")
        module = EarlyExitLM(model, cfg, seed=0, total_steps=total_steps).train()

        def forward(step: int) -> torch.Tensor:
            return module(**batch, step=step)["loss"]

    def step(i: int) -> float:
        start = time.perf_counter()
        forward(i).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return step


def _setup(shape: StepShape):
    model, _ = load_model(load_group("model", shape.model, ModelConfig))
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (shape.batch, shape.seq), generator=gen).to(model.device)
    return model, {"input_ids": ids, "labels": ids}


def measure_memory(shape: StepShape, kind: str) -> float:
    """Peak memory (MiB) of ``shape.steps`` steps of ``kind`` above the loaded model and batch (run each kind
    in a process of its own: the CPU's peak cannot be reset)."""
    model, batch = _setup(shape)
    step = _step_fn(kind, model, batch, shape.steps)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for i in range(shape.steps):
            step(i)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    import threading

    import psutil

    proc, peak, done = psutil.Process(), [0], threading.Event()
    base = proc.memory_info().rss

    def sample() -> None:  # the process peak cannot be reset on the CPU: sample RSS during the steps
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for i in range(shape.steps):
        step(i)
    done.set()
    sampler.join()
    return (peak[0] - base) / 2**20


def measure_time(shape: StepShape, kinds: list[str]) -> dict[str, list[float]]:
    """Seconds per step of each kind, interleaved (one model each, same batch)."""
    setups = {}
    for kind in kinds:
        model, batch = _setup(shape)
        setups[kind] = _step_fn(kind, model, batch, shape.steps + 1)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(shape.steps + 1):
        for kind in kinds:
            t = setups[kind](i)
            if i > 0:  # step 0 is warm-up
                times[kind].append(t)
    return times


def compare(shape: StepShape, times: dict[str, list[float]], memory: dict[str, float]) -> dict:
    """The report: per kind the median step time and peak memory, and both as ratios to the plain step."""
    base_t, base_m = statistics.median(times["plain"]), memory["plain"]
    return {
        "model": shape.model,
        "batch": shape.batch,
        "seq": shape.seq,
        "steps": shape.steps,
        "device": "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)",
        "measured_on": machine_label(
            "cuda" if torch.cuda.is_available() else None
        ),  # the step times' machine
        "kinds": {
            k: {
                "median_s": statistics.median(times[k]),
                "time_ratio": statistics.median(times[k]) / base_t,
                "peak_mib": memory[k],
                "memory_ratio": memory[k] / base_m if base_m else None,
            }
            for k in times
        },
    }
