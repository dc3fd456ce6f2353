"""Helpers shared by the Hydra entry points (train.py, collect_jacobi.py, eval/speed.py)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from fastdecode.io import atomic_write_text

log = logging.getLogger(__name__)


def strip_launcher_args(argv: list[str] | None = None) -> list[str]:
    """Remove ``--local_rank=N`` / ``--local-rank N`` that the DeepSpeed launcher appends.

    Hydra would reject them as unknown overrides; the rank is read from ``LOCAL_RANK`` instead, which
    every launcher (deepspeed, torchrun, accelerate) sets. Edits ``sys.argv`` in place by default.
    """
    args = sys.argv if argv is None else argv
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
            continue
        if arg in ("--local_rank", "--local-rank") and i + 1 < len(args):
            os.environ.setdefault("LOCAL_RANK", args[i + 1])
            skip = True
            continue
        out.append(arg)
    args[:] = out
    return args


def global_rank() -> int:
    """This process's rank in a multi-process launch (0 when launched alone)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def is_main_process() -> bool:
    return global_rank() == 0


def save_resolved_config(cfg: Any, output_dir: str | Path, name: str = "config.yaml") -> Path | None:
    """Write the fully resolved config next to the outputs (rank 0 only, atomically)."""
    if not is_main_process():
        return None
    from omegaconf import OmegaConf

    path = Path(output_dir) / name
    atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))
    log.info("resolved config saved to %s", path)
    return path
