"""The feature cache's settings (``FeatureConfig``, ``recipe.features`` of the recipes that train beside a
frozen model on its cached work: ``exit_adapter``, ``eagle3``); the cache itself is ``features.py``."""

from __future__ import annotations

from dataclasses import dataclass

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.runtime.weights import WEIGHTS

FEATURE_DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("data", "generate")


@dataclass
class FeatureConfig:
    """The cache of frozen-model work: layer-E features and teacher targets, computed once (resumable).

    ``source``: ``data`` = teacher-forced on the data config's training conversations; ``generate`` = the
    model's own greedy answers to the training split's first user turns, with the features and targets
    captured while it generates (one pass: no separate regeneration).
    """

    dir: str | None = None  # null: <output_dir>/features; share one across runs (its manifest is checked)
    source: str = "data"
    max_new_tokens: int = 192  # source=generate: answer length (EOS ends an answer earlier)
    max_prompt_tokens: int = 256  # source=generate: longer prompts are skipped
    exits: list[int] | None = None  # exits to cache (null: recipe.exits); a superset serves later runs
    top_k: int = 32
    dtype: str = "bfloat16"  # of the cached hidden states (targets are float32)
    batch_size: int = 8  # sequences per frozen forward
    shard_records: int = 64  # sequences per shard (the commit unit; a multiple of batch_size)
    max_records: int | None = None  # cache at most this many training sequences (null: all)
    # what the frozen model's products read while caching (decoder.weights: auto = a GGUF's 4-bit blocks
    # where they are exact on a CPU, else fp32; fastdecode/runtime/weights.py); recorded in the header
    weights: str = "auto"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise unknown_name_error("recipe.features.source", self.source, list(SOURCES))
        if self.max_new_tokens < 1 or self.max_prompt_tokens < 1:
            raise ConfigError("recipe.features.max_new_tokens and max_prompt_tokens must be >= 1.")
        if self.dtype not in FEATURE_DTYPES:
            raise unknown_name_error("recipe.features.dtype", self.dtype, list(FEATURE_DTYPES))
        if self.weights not in WEIGHTS:
            raise unknown_name_error("recipe.features.weights", self.weights, list(WEIGHTS))
        if self.top_k < 1 or self.batch_size < 1:
            raise ConfigError("recipe.features.top_k and batch_size must be >= 1.")
        if self.shard_records < 1 or self.shard_records % self.batch_size:
            raise ConfigError(
                f"recipe.features.shard_records={self.shard_records} must be a positive multiple of "
                f"batch_size={self.batch_size} (a resumed run then batches exactly like an uninterrupted one)."
            )

    def record_bytes(self, positions: int, scored: int, *, exits: int, hidden: int) -> int:
        """Bytes of one cached record (``fastdecode/training/features.py``'s fields) of a sequence of ``positions``
        tokens with ``scored`` trained positions, for ``exits`` exits and hidden size ``hidden``: ids and
        positions int32, hidden states at ``dtype``, top-k ids int32 and log-probabilities float32, plus the
        index and the per-field offsets (int64) of the shard."""
        width = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        per_position = 4 + exits * hidden * width  # input_ids, h<E>
        per_scored = 3 * 4 + self.top_k * (4 + 4) + hidden * width  # scored/targets/teacher, top-k, final
        return positions * per_position + scored * per_scored + 8 * (1 + 7 + exits)


@dataclass
class ReportConfig:
    """``recipe.report`` of a drafter trained on the feature cache (EAGLE-3, DFlash): its drafting acceptance
    on the target's own greedy answers to held-out prompts."""

    enabled: bool = True
    prompts: int = 16  # held-out prompts the target answers greedily (never the training data)
    max_new_tokens: int = 64
    max_prompt_tokens: int = 256  # longer prompts are skipped
    data: str | None = None  # held-out prompts: null = the training data's held-out split; or a data config
    batch_size: int = 8  # prompts per generation batch
