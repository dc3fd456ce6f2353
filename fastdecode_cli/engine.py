"""``fastdecode-engine`` / ``python eval/engine.py``: the execution-engine micro-benchmark.

Forward cost vs T new tokens per execution path (HF modules, fastdecode's engine, static cache, compiled),
per-layer-call overhead, autoregressive tok/s against HF ``generate`` and the streaming roofline, per thread
count; writes ``engine.json`` and ``engine.md`` into ``output_dir``. The code is ``fastdecode/bench/engine.py``.
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from fastdecode.config import CONFIG_DIR
from fastdecode_cli.launch import check_command_line, one_line_errors


def run(cfg: Any) -> dict:
    from fastdecode.bench.engine import run as run_engine

    return run_engine(cfg)


@hydra.main(config_path=str(CONFIG_DIR), config_name="engine", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    from fastdecode.bench.engine_report import to_markdown

    print(to_markdown(run(cfg)))


@one_line_errors
def main() -> None:
    check_command_line("engine")  # misspelt keys get our did-you-mean; a read-only output_dir is refused
    _main()


if __name__ == "__main__":
    main()
