"""``fastdecode-collect-throughput`` / ``python eval/collect_throughput.py model=smollm2-135m bench_prompts=8``.

Trajectory collection throughput: our collector against the CLLM reference procedure on the same prompts
(``cllm_train/throughput.py``); every ``collect_jacobi.yaml`` key applies. Writes ``collect_throughput.json``
into ``output_dir``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from fastdecode.config import CONFIG_DIR
from fastdecode_cli.launch import check_command_line, one_line_errors

BENCH_KEYS = ("bench_prompts", "warmup")  # the benchmark's own keys; the rest is a CollectJob


def run(cfg: Any) -> dict:
    """Time ours against the reference on ``bench_prompts`` prompts; returns (and writes) the report."""
    from cllm_train.collect import CollectJob
    from cllm_train.throughput import collect_throughput
    from fastdecode.config import to_dataclass, to_plain
    from fastdecode.files.io import atomic_write_json, check_writable

    plain = to_plain(cfg)
    bench = {k: plain.pop(k) for k in BENCH_KEYS}
    job = to_dataclass(CollectJob, plain, "")
    check_writable(job.output_dir)  # before the models load
    report = collect_throughput(job, **bench)
    atomic_write_json(Path(job.output_dir) / "collect_throughput.json", report)
    return report


@hydra.main(config_path=str(CONFIG_DIR), config_name="collect_throughput", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    print(OmegaConf.to_yaml(OmegaConf.create(run(cfg))))


@one_line_errors
def main() -> None:
    check_command_line("collect_throughput")  # misspelt keys get our did-you-mean; --help lists its groups
    _main()


if __name__ == "__main__":
    main()
