"""Decoding speed: ``python eval/speed.py model=smollm2-135m checkpoint=PATH decoder=[autoregressive,...]``.

Every selected method (``configs/decoder``) runs on the same model and prompts, interleaved in one process after
warm-up; writes ``speed.json``, ``summary.csv``, ``records.csv``, ``speed.md`` and plots into ``output_dir``
(default ``outputs/speed/<model>``). ``mode=sweep`` grids the exit layer x draft length. See
``fastdecode/bench/``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


def run(cfg: Any) -> dict:
    """Run the benchmark described by the composed ``configs/speed.yaml``; returns the written result."""
    from fastdecode.bench.speed import run as run_speed

    return run_speed(cfg)


@hydra.main(config_path="../configs", config_name="speed", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from fastdecode.bench.report import to_markdown

    print(to_markdown(run(cfg)))


if __name__ == "__main__":
    main()
