"""Prompt lookup's variants replayed over the model's own greedy answers to training prompts, and the
acceptance prior: ``python eval/lookup_replay.py [model=smollm2-135m] [num_prompts=128]``.

The same command as the console script ``fastdecode-lookup-replay``; the code is ``fastdecode_cli/lookup_replay.py``
(the work: ``fastdecode/bench/lookup_answers.py``, ``lookup_replay.py``).
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdecode_cli.lookup_replay import main, run  # noqa: E402

__all__ = ["main", "run"]

if __name__ == "__main__":
    main()
