"""``fastdecode-export-exit``: a checkpoint's exit as a draft model, e.g.
``fastdecode-export-exit checkpoint=outputs/layerskip-smollm2-135m/final exit_layer=8``.

Writes the checkpoint's first E layers, final norm and LM head as a plain Hugging Face directory with
``num_hidden_layers: E`` (``fastdecode.drafters.exits.export.export_exit``), which transformers' ``assistant_model=``,
vLLM's and SGLang's draft-model speculation and llama.cpp's ``-md`` (after GGUF conversion) load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from fastdecode.config import CONFIG_DIR, ConfigError, to_dataclass
from fastdecode_cli.launch import check_command_line, one_line_errors


@dataclasses.dataclass
class ExportExitJob:
    checkpoint: str | None = None
    exit_layer: int | None = None
    output_dir: str | None = None


def run(cfg: Any) -> Path:
    """Export the exit ``cfg`` names; returns the directory written."""
    from fastdecode.drafters.exits.export import export_exit

    job = to_dataclass(ExportExitJob, cfg, "")
    if not job.checkpoint:
        raise ConfigError("set checkpoint=PATH: the checkpoint directory whose exit to export.")
    return export_exit(job.checkpoint, job.exit_layer, job.output_dir)


@hydra.main(config_path=str(CONFIG_DIR), config_name="export_exit", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    print(f"draft model written: {run(cfg)}")


@one_line_errors
def main() -> None:
    check_command_line("export_exit")  # misspelt keys get our did-you-mean; --help lists this config's keys
    _main()


if __name__ == "__main__":
    main()
