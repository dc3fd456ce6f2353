"""Cost of a LayerSkip training step vs a plain fine-tuning step, same model and batch.

    python eval/train_cost.py [--model smollm2-135m] [--batch 4] [--seq 256] [--steps 6]

The same command as the console script ``fastdecode-train-cost``; the code is ``fastdecode_cli/train_cost.py``
(the measurement: ``layerskip_train/step_cost.py``).
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdecode_cli.train_cost import main, run  # noqa: E402

__all__ = ["main", "run"]

if __name__ == "__main__":
    main()
