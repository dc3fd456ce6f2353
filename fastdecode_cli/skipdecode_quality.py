"""``fastdecode-skipdecode-quality`` / ``python eval/skipdecode_quality.py [checkpoint=PATH] [skip.max_budget=20 ...]``.

Writes ``skipdecode_quality.json`` into ``output_dir``: the ``skipdecode`` decoder's greedy outputs scored
against full-depth decoding (``fastdecode/reports/skipdecode.py``). A checkpoint trained with
``recipe=skipdecode`` is decoded with the policy it was trained with, and ``skip.*`` options that contradict
it are refused before the model loads. What the report holds: docs/design/cli.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from fastdecode.config import CONFIG_DIR, ModelConfig, to_dataclass
from fastdecode.data.config import DataConfig
from fastdecode_cli.launch import check_command_line, one_line_errors


@dataclasses.dataclass
class QualityJob:
    model: ModelConfig
    data: DataConfig
    # DecodeConfig.skip (fastdecode.skipdecode.SkipOptions), converted in run(): importing the decoders at the
    # top would make --help and --cfg wait for torch and transformers.
    skip: dict = dataclasses.field(default_factory=dict)
    skip_file: str | None = "auto"
    checkpoint: str | None = None
    prompts: int = 32
    max_new_tokens: int = 64
    batch_size: int = 8
    output_dir: str = "outputs/skipdecode-quality"


def run(cfg: Any) -> dict:
    """Decode the held-out prompts both ways, score, write and return the report."""
    from fastdecode.data.chat import build_datasets
    from fastdecode.decoding.config import DecodeConfig
    from fastdecode.files.checkpoint_info import checkpoint_model
    from fastdecode.files.io import atomic_write_json, check_writable
    from fastdecode.reports.skipdecode import skipdecode_quality, split_examples
    from fastdecode.runtime.loading import load_model
    from fastdecode.runtime.model import EarlyExitModel
    from fastdecode.skipdecode import SkipOptions, read_trained_policy, trained_options, trained_policy_file
    from fastdecode.tokens import eos_ids

    job = to_dataclass(QualityJob, cfg, "")
    model_cfg = checkpoint_model(job.model, job.checkpoint)  # a contradicting model= fails before any load
    skip_file = trained_policy_file(job.checkpoint, job.skip_file)
    skip = to_dataclass(SkipOptions, job.skip, "skip")
    if skip_file:  # the policy the checkpoint was trained with: contradicting options fail before any load
        override = "set skip_file=null"
        skip = trained_options(
            read_trained_policy(skip_file), skip, source=skip_file, override=override, keys="skip."
        )
    decode = DecodeConfig(max_new_tokens=job.max_new_tokens, skip=skip)
    check_writable(job.output_dir)  # before the model loads
    model, tokenizer = load_model(model_cfg)
    decode = dataclasses.replace(decode, eos_token_id=sorted(eos_ids(model, tokenizer)))
    held_out = build_datasets(dataclasses.replace(job.data, max_samples=1), tokenizer)[1][: job.prompts]
    report = skipdecode_quality(
        EarlyExitModel(model), split_examples(held_out), decode, held_out, job.batch_size
    )
    report["options"] = {
        "skip": dataclasses.asdict(skip),
        "skip_file": skip_file,
        "checkpoint": job.checkpoint,
    }
    atomic_write_json(Path(job.output_dir) / "skipdecode_quality.json", report)
    return report


@hydra.main(config_path=str(CONFIG_DIR), config_name="skipdecode_quality", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    report = run(cfg)
    print({k: v for k, v in report.items() if k != "options"})


@one_line_errors
def main() -> None:
    check_command_line("skipdecode_quality")  # checkpoint= alone is the model; misspelt keys: did-you-mean
    _main()


if __name__ == "__main__":
    main()
