"""Train a model for faster decoding: ``python train.py recipe=layerskip model=llama2-7b data=sharegpt``.

A thin Hydra wrapper: the work is ``recipes.run(cfg)``, which tests call directly.
Multi-process: ``torchrun --nproc_per_node N train.py ...`` or ``deepspeed train.py deepspeed=zero3 ...``.
"""

from fastdecode.cli import strip_launcher_args

strip_launcher_args()  # the DeepSpeed launcher appends --local_rank=N, which Hydra would reject

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import recipes

    recipes.run(cfg)


if __name__ == "__main__":
    main()
