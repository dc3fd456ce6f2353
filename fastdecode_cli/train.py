"""``fastdecode-train`` / ``python train.py``: train a model for faster decoding.

``fastdecode-train recipe=layerskip model=llama2-7b data=sharegpt``. The work is ``recipes.run(cfg)``.
Multi-process: ``torchrun --nproc_per_node N train.py ...`` or ``deepspeed train.py deepspeed=zero3 ...``.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from fastdecode.config import CONFIG_DIR
from fastdecode_cli.launch import check_command_line, one_line_errors, strip_launcher_args


@hydra.main(config_path=str(CONFIG_DIR), config_name="train", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    import recipes

    recipes.run(cfg)


@one_line_errors
def main() -> None:
    strip_launcher_args()  # the DeepSpeed launcher appends --local_rank=N, which Hydra would reject
    check_command_line("train")  # misspelt keys get our did-you-mean; --help lists train's groups only
    _main()


if __name__ == "__main__":
    main()
