"""SkipDecode quality: ``python eval/skipdecode_quality.py [checkpoint=PATH] [skip.max_budget=20 ...]``.

The same command as the console script ``fastdecode-skipdecode-quality``; the code is
``fastdecode_cli/skipdecode_quality.py``.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdecode_cli.skipdecode_quality import QualityJob, main, run  # noqa: E402

__all__ = ["QualityJob", "main", "run"]

if __name__ == "__main__":
    main()
