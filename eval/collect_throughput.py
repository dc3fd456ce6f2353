"""Trajectory collection throughput: ``python eval/collect_throughput.py model=smollm2-135m bench_prompts=8``.

The same command as the console script ``fastdecode-collect-throughput``; the code is
``fastdecode_cli/collect_throughput.py`` (the measurement: ``cllm_train/throughput.py``).
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdecode_cli.collect_throughput import main, run  # noqa: E402

__all__ = ["main", "run"]

if __name__ == "__main__":
    main()
