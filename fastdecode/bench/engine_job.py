"""The job of the execution-engine micro-benchmark (``configs/engine.yaml``, ``fastdecode/bench/engine.py``)
and the execution paths it compares: ``hf`` (the HF modules), ``engine`` (the default engine, lean layers),
``static`` (with the static cache) and ``compile`` (compiled layer ranges on the static cache).
"""

from __future__ import annotations

import dataclasses

import torch

from fastdecode.config import ConfigError, ModelConfig
from fastdecode.runtime.engine import EngineOptions, default_options

PATHS = ("hf", "engine", "static", "compile")
COMPONENTS = ("model", "layers_lo", "layers_hi", "head", "head_subset")


@dataclasses.dataclass
class EngineJob:
    model: ModelConfig
    exit_layer: int = 8
    context: int = 300
    steps: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 3, 5, 9, 17])
    components: list[str] = dataclasses.field(default_factory=lambda: list(COMPONENTS))
    paths: list[str] = dataclasses.field(default_factory=lambda: ["hf", "engine"])
    ar_paths: list[str] = dataclasses.field(default_factory=lambda: ["hf", "engine"])
    subset_rows: int = 8192
    threads: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    repeats: int = 5
    calls: int = 3
    overhead: bool = True
    overhead_model: dict = dataclasses.field(
        default_factory=lambda: {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 30}
    )
    ar: bool = True
    ar_batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [1])
    ar_new_tokens: int = 32
    ar_repeats: int = 3
    bf16: bool = True
    bandwidth_mb: int = 1024
    seed: int = 0
    output_dir: str = "outputs/engine"

    def __post_init__(self) -> None:
        for path in self.paths + self.ar_paths:
            if path not in PATHS:
                raise ConfigError(f"paths / ar_paths: unknown path '{path}'; choices: {', '.join(PATHS)}.")
        for comp in self.components:
            if comp not in COMPONENTS:
                raise ConfigError(f"engine.components: unknown '{comp}'; choices: {', '.join(COMPONENTS)}.")
        if "hf" not in self.paths:
            raise ConfigError("engine.paths must include 'hf' (the reference every ratio refers to).")


def path_options(path: str, device: torch.device) -> EngineOptions | None:
    """The engine of a path: lean layers always (the point of the comparison, also on CUDA, where they are
    not the default), packed kernels where they are the default (CPU)."""
    if path == "hf":
        return None
    return default_options(
        device, fast_layers=True, static_cache=path in ("static", "compile"), compile=path == "compile"
    )


def decode_flags(path: str) -> dict:
    """The ``DecodeConfig`` engine flags of a path (``hf``: the HF modules, no packed kernels)."""
    if path == "hf":
        return {"fast_layers": False, "fast_linear": False}
    return {"fast_layers": True, "static_cache": path in ("static", "compile"), "compile": path == "compile"}
