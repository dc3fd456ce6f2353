"""An EAGLE-3 training step on a model's real shapes, and a random-init head for decoding checks (the EAGLE-3
line of ``eval/gpu_check.sh``).

    python eval/eagle3_check.py model=random-llama2-7b model.device=cuda model.dtype=bfloat16 out=DIR

The same command as the console script ``fastdecode-eagle3-check``; the code is ``fastdecode_cli/eagle3_check.py``.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdecode_cli.eagle3_check import main  # noqa: E402

__all__ = ["main"]

if __name__ == "__main__":
    main()
