"""Collect Jacobi trajectories for CLLM training: ``python collect_jacobi.py model=smollm2-135m data=sharegpt``.

The same command as the console script ``fastdecode-collect``; the code is ``fastdecode_cli/collect.py``.
Multi-process: ``torchrun --nproc_per_node N collect_jacobi.py ...``; rerun with the same ``output_dir`` to resume.
"""

from fastdecode_cli.collect import main

if __name__ == "__main__":
    main()
