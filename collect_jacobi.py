"""Collect Jacobi trajectories for CLLM training: ``python collect_jacobi.py model=smollm2-135m data=sharegpt``.

A thin Hydra wrapper: the work is ``cllm_train.collect.run(cfg)``, which tests call directly.
Multi-process: ``torchrun --nproc_per_node N collect_jacobi.py ...`` (each rank writes its own shards, rank 0
merges the manifest). Rerun with the same ``output_dir`` to resume an interrupted collection.
"""

from fastdecode.cli import strip_launcher_args

strip_launcher_args()  # the DeepSpeed launcher appends --local_rank=N, which Hydra would reject

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="configs", config_name="collect_jacobi", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from cllm_train.collect import run

    run(cfg)


if __name__ == "__main__":
    main()
