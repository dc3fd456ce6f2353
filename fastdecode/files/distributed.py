"""Rank and world size of a multi-process launch, read one way everywhere (torchrun, deepspeed, accelerate).

Every launcher sets ``RANK``/``WORLD_SIZE`` (``LOCAL_RANK`` alone when the DeepSpeed launcher's ``--local_rank``
was the only hint); a process launched alone is rank 0 of 1.
"""

from __future__ import annotations

import os


def global_rank() -> int:
    """This process's rank in a multi-process launch (0 when launched alone)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def world_size() -> int:
    """The number of processes in the launch (1 when launched alone)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return global_rank() == 0
