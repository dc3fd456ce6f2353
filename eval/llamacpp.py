"""llama.cpp beside fastdecode on the same GGUF: ``python eval/llamacpp.py [--threads 1,2] [--method auto:weights=int4]``.

The same command as the console script ``fastdecode-llamacpp``; the code is ``fastdecode_cli/llamacpp.py`` (the
work: ``fastdecode/bench/llamacpp.py``). Needs the ``llamacpp`` extra (llama-cpp-python; pyproject.toml).
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdecode_cli.llamacpp import main, parse_args, run  # noqa: E402

__all__ = ["main", "parse_args", "run"]

if __name__ == "__main__":
    main()
