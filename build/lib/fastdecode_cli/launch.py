"""What the multi-process launchers need from the entry points before Hydra parses the command line."""

from __future__ import annotations

import os
import sys


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
