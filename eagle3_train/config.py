"""``configs/recipe/eagle3.yaml`` as typed dataclasses, and the checks that run before the weights load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3_train.losses import KINDS
from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.drafters.eagle3.model import NORM_BEFORE_RESIDUAL, default_aux_layers
from fastdecode.training.feature_config import FeatureConfig, ReportConfig

MODES = ("cache", "online")
INITS = ("target_head", "random")


@dataclass
class Eagle3Features(FeatureConfig):
    """Where the target's features come from (``fastdecode/training/features.py``'s records).

    ``mode``: ``cache`` = the feature cache (computed once, resumable, shared across runs; ``source=generate``
    = the target's own greedy answers to the training split's first user turns, captured while it generates;
    ``source=data`` = teacher-forced on the data's conversations); ``online`` = the frozen target computes
    each batch's features from the data in the same process (no cache; ``source`` must be ``data``, e.g. a
    jsonl of the target's regenerated answers from ``fastdecode-regenerate``).
    """

    mode: str = "cache"
    source: str = "generate"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise unknown_name_error("recipe.features.mode", self.mode, list(MODES))
        if self.mode == "online" and self.source != "data":
            raise ConfigError(
                "recipe.features.mode=online computes each batch's features from the data's conversations "
                "(teacher-forced), so it cannot generate them: set recipe.features.source=data with the "
                "target's own answers as data (data=jsonl data.path=<fastdecode-regenerate output>), or use "
                "recipe.features.mode=cache with source=generate."
            )


@dataclass
class Eagle3RecipeConfig:
    name: str = "eagle3"
    aux_layer_ids: list[int] | None = None  # the target's feature layers (null: [2, L // 2, L - 3])
    draft_vocab_size: int = 8192  # the most frequent tokens of the training answers (<= the target's vocab)
    ttt_steps: int = 3  # training-time test unroll
    step_decay: float = 0.8  # step k's loss weighs decay ** k
    loss: str = "kl"  # kl (to the target's distribution over the draft vocab) | ce (to its argmax)
    prev_correct: bool = False  # step k scores a position only where steps < k matched the target
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per feature before fc
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc
    norm_before_residual: bool = NORM_BEFORE_RESIDUAL  # the head's one default (false: both engines serve it)
    init: str = "target_head"  # target_head (lm_head = the target's rows of the draft vocab) | random
    speculative_tokens: int = 3  # K written into final/config.json (the servers' default draft length)
    features: Eagle3Features = field(default_factory=Eagle3Features)
    report: ReportConfig = field(default_factory=ReportConfig)

    def __post_init__(self) -> None:
        if self.loss not in KINDS:
            raise unknown_name_error("recipe.loss", self.loss, list(KINDS))
        if self.init not in INITS:
            raise unknown_name_error("recipe.init", self.init, list(INITS))
        if self.ttt_steps < 1 or self.speculative_tokens < 1:
            raise ConfigError(
                f"recipe.ttt_steps={self.ttt_steps} and recipe.speculative_tokens={self.speculative_tokens} "
                "must be >= 1."
            )
        if not 0 < self.step_decay <= 1:
            raise ConfigError(f"recipe.step_decay={self.step_decay}: give a weight in (0, 1].")
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError(
                "recipe.fc_norm and recipe.norm_before_fc are mutually exclusive (per-feature norms vs one "
                "norm over the concatenation): set one of them to false."
            )
        if self.draft_vocab_size < 1:
            raise ConfigError(f"recipe.draft_vocab_size={self.draft_vocab_size}: give at least 1.")

    def aux_layers(self, num_layers: int) -> list[int]:
        """The feature layers for a target of ``num_layers`` layers, checked: three distinct ids in
        ``[1, num_layers - 1]`` (the residual stream after that many blocks), refused here, before the
        weights load. Narrower than the head's ``[0, L - 1]`` (``model.check_aux_layer_ids``, which says why
        L is never meant): id 0, the embedding output, is refused at training time because a run exports
        for SGLang too, which cannot capture it (``files.sglang_unsupported``), and the cache holds none."""
        try:
            ids = (
                list(self.aux_layer_ids) if self.aux_layer_ids is not None else default_aux_layers(num_layers)
            )
        except ConfigError as err:
            raise ConfigError(f"recipe.aux_layer_ids=null: {err}") from err
        if len(ids) != 3 or len(set(ids)) != 3 or any(not 1 <= i < num_layers for i in ids):
            given = (
                ids if self.aux_layer_ids is not None else f"null (the default [2, L // 2, L - 3] = {ids})"
            )
            raise ConfigError(
                f"recipe.aux_layer_ids={given} but the target has {num_layers} layers: give three distinct ids "
                f"in [1, {num_layers - 1}] (the residual stream after that many blocks; not 0, the embedding "
                f"output SGLang cannot capture, nor {num_layers}, after the final block), or null for "
                "[2, L // 2, L - 3]."
            )
        return sorted(ids)

    def cached_exits(self, num_layers: int) -> list[int]:
        """The exits the feature cache holds: ``features.exits`` (a superset serves later runs) and the
        feature layers."""
        return sorted(set(self.features.exits or []) | set(self.aux_layers(num_layers)))

    def validate(self, config: Any) -> None:
        """Every setting against the target's HF ``config`` (read without its weights)."""
        layers = config.num_hidden_layers
        self.aux_layers(layers)
        for e in self.features.exits or []:
            if not 1 <= e < layers:
                raise ConfigError(
                    f"recipe.features.exits has {e} but the target has {layers} layers: cache exits in "
                    f"[1, {layers - 1}]."
                )
        if self.draft_vocab_size > config.vocab_size:
            raise ConfigError(
                f"recipe.draft_vocab_size={self.draft_vocab_size} is larger than the target's vocabulary "
                f"({config.vocab_size}): give at most {config.vocab_size}."
            )
