"""Execution-engine micro-benchmark: ``python eval/engine.py [model=smollm2-135m] ['threads=[1,2]']``.

The same command as the console script ``fastdecode-engine``; the code is ``fastdecode_cli/engine.py``.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdecode_cli.engine import main, run  # noqa: E402

__all__ = ["main", "run"]

if __name__ == "__main__":
    main()
