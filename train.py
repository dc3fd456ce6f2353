"""Train a model for faster decoding: ``python train.py recipe=layerskip model=llama2-7b data=sharegpt``.

The same command as the console script ``fastdecode-train``; the code is ``fastdecode_cli/train.py``.
Multi-process: ``torchrun --nproc_per_node N train.py ...`` or ``deepspeed train.py deepspeed=zero3 ...``.
"""

from fastdecode_cli.train import main

if __name__ == "__main__":
    main()
