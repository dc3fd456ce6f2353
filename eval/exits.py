"""Per-exit quality report: ``python eval/exits.py checkpoint=outputs/layerskip-smollm2-135m/final``.

The same command as the console script ``fastdecode-exits``; the code is ``fastdecode_cli/exits.py``.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdecode_cli.exits import ExitsJob, main, run  # noqa: E402

__all__ = ["ExitsJob", "main", "run"]

if __name__ == "__main__":
    main()
