"""``fastdecode-speed`` / ``python eval/speed.py``: decoding speed of every selected method, side by side.

Every selected method (``configs/decoder``) runs on the same model and prompts, interleaved in one process after
warm-up; writes ``speed.json``, ``summary.csv``, ``records.csv``, ``speed.md`` and plots into ``output_dir``
(default ``outputs/speed/<model>``). ``mode=sweep`` grids the exit layer x draft length. See
``fastdecode/bench/``.
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from fastdecode.config import CONFIG_DIR
from fastdecode_cli.launch import check_command_line, one_line_errors


def run(cfg: Any) -> dict:
    """Run the benchmark described by the composed ``configs/speed.yaml``; returns the written result."""
    from fastdecode.bench.speed import run as run_speed

    return run_speed(cfg)


@hydra.main(config_path=str(CONFIG_DIR), config_name="speed", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    from fastdecode.bench.report import to_markdown

    print(to_markdown(run(cfg)))


@one_line_errors
def main() -> None:
    check_command_line("speed")  # misspelt keys get our did-you-mean; --help lists this config's groups
    _main()


if __name__ == "__main__":
    main()
