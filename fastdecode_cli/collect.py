"""``fastdecode-collect`` / ``python collect_jacobi.py``: collect Jacobi trajectories for CLLM training.

The work is ``cllm_train.collect.run(cfg)``. Multi-process: ``torchrun --nproc_per_node N collect_jacobi.py ...``
(each rank writes its own shards, rank 0 merges the manifest). Rerun with the same ``output_dir`` to resume.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from fastdecode.config import CONFIG_DIR
from fastdecode_cli.launch import check_command_line, one_line_errors, strip_launcher_args


@hydra.main(config_path=str(CONFIG_DIR), config_name="collect_jacobi", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    from cllm_train.collect import run

    run(cfg)


@one_line_errors
def main() -> None:
    strip_launcher_args()  # the DeepSpeed launcher appends --local_rank=N, which Hydra would reject
    check_command_line("collect_jacobi")  # misspelt keys get our did-you-mean
    _main()


if __name__ == "__main__":
    main()
