"""``fastdecode-train-cost`` / ``python eval/train_cost.py``: a LayerSkip training step against a plain one.

    fastdecode-train-cost [--model smollm2-135m] [--batch 4] [--seq 256] [--steps 6] [--out cost.json]

Time: every kind interleaved in this process; peak memory: each kind in a subprocess of its own
(``layerskip_train/step_cost.py``). Prints the report as JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from fastdecode_cli.launch import USER_ERROR_EXIT, one_line_errors

KINDS = "plain,layerskip,layerskip-fraction0.25,layerskip-3exits-distill"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kinds", default=KINDS)
    parser.add_argument("--memory-only", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    return parser.parse_args(argv)


def memory_in_subprocess(shape, kind: str) -> float:
    """Peak MiB of ``kind``, measured by this module run as ``--memory-only`` in a fresh process."""
    root = str(Path(__file__).resolve().parents[1])  # this checkout (or site-packages) importable there
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "fastdecode_cli.train_cost", "--memory-only", kind, "--model", shape.model]
    cmd += ["--batch", str(shape.batch), "--seq", str(shape.seq), "--steps", str(min(shape.steps, 3))]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]
    from fastdecode.errors import UserError

    lines = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == USER_ERROR_EXIT and lines and lines[-1].startswith("error: "):  # the child's own
        raise UserError(f"measuring the peak memory of {kind}: {lines[-1].removeprefix('error: ')}")
    sys.stderr.write(done.stderr)  # a crash: the child's traceback, then ours
    raise RuntimeError(
        f"the peak-memory subprocess of {kind} failed (exit code {done.returncode}); its output is above: "
        f"{' '.join(cmd)}"
    )


def run(args: argparse.Namespace) -> dict:
    """Measure every kind of ``args.kinds`` and return the report (``--memory-only KIND``: that kind's peak)."""
    from fastdecode.config import unknown_name_error
    from layerskip_train.step_cost import VARIANTS, StepShape, compare, measure_memory, measure_time

    shape = StepShape(args.model, args.batch, args.seq, args.steps)
    if args.memory_only:
        return {"peak_mib": measure_memory(shape, args.memory_only)}
    kinds = args.kinds.split(",")
    for kind in kinds:  # before any model loads
        if kind != "plain" and kind not in VARIANTS:
            raise unknown_name_error("step kind", kind, ["plain", *VARIANTS], "(--kinds)")
    times = measure_time(shape, kinds)
    memory = {kind: memory_in_subprocess(shape, kind) for kind in kinds}
    return compare(shape, times, memory)


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.memory_only:
        print(json.dumps(result))
        return
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
