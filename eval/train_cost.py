"""Cost of a LayerSkip training step vs a plain fine-tuning step, same model and batch.

    python eval/train_cost.py [--model smollm2-135m] [--batch 4] [--seq 256] [--steps 6]

Time: all kinds of step run in one process, interleaved after warm-up, so machine drift cancels; the ratio
of medians is reported. Peak memory: each kind runs in its own subprocess (CPU: peak RSS sampled every 2 ms
during the steps, above the RSS after loading the model and building the optimiser; CUDA:
``max_memory_allocated`` above the allocation before the steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastdecode.config import ModelConfig, load_group  # noqa: E402
from fastdecode.loading import load_model  # noqa: E402

RECIPES = {
    # The recipe's default: strided exits over every layer (every 4th layer a step), exp dropout 0.1.
    "layerskip": {},
    # The tuned CPU experiment: three exits, self-distillation.
    "layerskip-3exits-distill": {
        "early_exit_loss": {"layers": "9,18,24", "curriculum": "none", "distill": 1.0},
    },
    # Strided exits, each non-final exit scored on a random quarter of the tokens (unbiased estimate).
    "layerskip-fraction0.25": {"early_exit_loss": {"token_fraction": 0.25}},
}


def _step_fn(kind: str, model, batch: dict, total_steps: int):
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

        cfg = to_dataclass(LayerSkipConfig, RECIPES[kind], "recipe")
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


def _setup(args):
    model, _ = load_model(load_group("model", args.model, ModelConfig))
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen).to(model.device)
    return model, {"input_ids": ids, "labels": ids}


def measure_memory(args, kind: str) -> float:
    """Peak memory (MiB) of ``args.steps`` steps of ``kind`` above the loaded model and batch."""
    model, batch = _setup(args)
    step = _step_fn(kind, model, batch, args.steps)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for i in range(args.steps):
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
    for i in range(args.steps):
        step(i)
    done.set()
    sampler.join()
    return (peak[0] - base) / 2**20


def measure_time(args, kinds: list[str]) -> dict[str, list[float]]:
    """Seconds per step of each kind, interleaved (one model each, same batch)."""
    setups = {}
    for kind in kinds:
        model, batch = _setup(args)
        setups[kind] = _step_fn(kind, model, batch, args.steps + 1)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(args.steps + 1):
        for kind in kinds:
            t = setups[kind](i)
            if i > 0:  # step 0 is warm-up
                times[kind].append(t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kinds", default="plain,layerskip,layerskip-fraction0.25,layerskip-3exits-distill")
    parser.add_argument("--memory-only", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args()
    if args.memory_only:
        print(json.dumps({"peak_mib": measure_memory(args, args.memory_only)}))
        return
    kinds = args.kinds.split(",")
    times = measure_time(args, kinds)
    memory = {}
    for kind in kinds:
        cmd = [
            sys.executable,
            __file__,
            "--memory-only",
            kind,
            "--model",
            args.model,
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--steps",
            str(min(args.steps, 3)),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        memory[kind] = json.loads(out)["peak_mib"]
    base_t, base_m = statistics.median(times["plain"]), memory["plain"]
    result = {
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "device": "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)",
        "kinds": {
            k: {
                "median_s": statistics.median(times[k]),
                "time_ratio": statistics.median(times[k]) / base_t,
                "peak_mib": memory[k],
                "memory_ratio": memory[k] / base_m if base_m else None,
            }
            for k in kinds
        },
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
