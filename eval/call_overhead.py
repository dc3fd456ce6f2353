"""What ``FastDecoder.generate`` costs beyond its decoder:
``python eval/call_overhead.py [--model smollm2-135m] [--tokens 1,48] [--threads 1]``.

The same command as the console script ``fastdecode-call-overhead``; the code is ``fastdecode_cli/call_overhead.py``
(the work: ``fastdecode/bench/call_overhead.py``).
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdecode_cli.call_overhead import main, run  # noqa: E402

__all__ = ["main", "run"]

if __name__ == "__main__":
    main()
