"""``configs/recipe/cllm.yaml`` as typed dataclasses: consistency training on Jacobi trajectories.

Every value is checked here, at conversion time, so a bad option fails before the tokenizer, the trajectories
or the model are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdecode.config import ConfigError, unknown_name_error

CONSISTENCY_LOSSES = ("global", "local", "both")
AR_TARGETS = ("labels", "fixed_point")


@dataclass
class CLLMReportConfig:
    """The before/after measurement: held-out perplexity and Jacobi tokens per forward pass."""

    enabled: bool = True
    before: bool = True  # also measure the untrained model (skip it when sweeping configurations)
    held_out_examples: int = 32  # held-out conversations of the data group scored for perplexity
    prompts: int = 8  # held-out prompts decoded with the Jacobi decoder (tokens per forward)
    max_new_tokens: int = 64
    block_size: int | None = None  # Jacobi block n; None: the block size of the trajectories

    def __post_init__(self) -> None:
        for key in ("held_out_examples", "prompts", "max_new_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"recipe.report.{key} must be >= 0, got {getattr(self, key)}.")
        if self.block_size is not None and self.block_size < 2:
            raise ConfigError(f"recipe.report.block_size must be >= 2 or null, got {self.block_size}.")


@dataclass
class CLLMConfig:
    """Consistency + AR loss (Kou et al., 2024): ``L = L_consistency + ar_weight * L_AR``.

    ``trajectories`` is a directory written by ``collect_jacobi.py`` with the model being trained.
    ``ar_target``: ``labels`` (ground-truth replies, the authors' advice against collapse) or ``fixed_point``
    (prefix + y*, the model's own greedy output). ``mask_prompt`` drops the prompt tokens from the AR loss
    (the reference keeps them). ``max_length`` caps every training sequence: the prefix is cut on the left.
    ``seed`` seeds the per-step state draws (null: the job seed).
    """

    name: str = "cllm"
    trajectories: str | None = None
    consistency_loss: str = "global"
    ar_weight: float = 10.0
    label_smoothing: float = 0.1
    ar_target: str = "labels"
    mask_prompt: bool = True
    max_length: int = 1024
    max_records: int | None = None  # train on the first N records (in manifest order); null: all
    seed: int | None = None
    report: CLLMReportConfig = field(default_factory=CLLMReportConfig)

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise ConfigError(
                "recipe.trajectories is not set: collect Jacobi trajectories with the model first "
                "(python collect_jacobi.py model=...) and pass recipe.trajectories=DIR."
            )
        if self.consistency_loss not in CONSISTENCY_LOSSES:
            raise unknown_name_error(
                "consistency loss",
                self.consistency_loss,
                list(CONSISTENCY_LOSSES),
                "(recipe.consistency_loss)",
            )
        if self.ar_target not in AR_TARGETS:
            raise unknown_name_error("AR target", self.ar_target, list(AR_TARGETS), "(recipe.ar_target)")
        if self.ar_weight < 0:
            raise ConfigError(f"recipe.ar_weight must be >= 0, got {self.ar_weight} (the paper uses 10).")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"recipe.label_smoothing must be in [0, 1), got {self.label_smoothing}.")
        if self.max_length < 3:
            raise ConfigError(f"recipe.max_length must be >= 3 tokens, got {self.max_length}.")
        if self.max_records is not None and self.max_records < 1:
            raise ConfigError(f"recipe.max_records must be >= 1 or null (all), got {self.max_records}.")

    @property
    def uses_global(self) -> bool:
        return self.consistency_loss in ("global", "both")

    @property
    def uses_local(self) -> bool:
        return self.consistency_loss in ("local", "both")

    @property
    def uses_ar(self) -> bool:
        return self.ar_weight > 0
