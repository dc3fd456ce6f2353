"""``configs/recipe/dflash.yaml`` as typed dataclasses, and the checks that run before the weights load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_train.losses import KINDS
from dflash_train.scaling import SCALES
from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.drafters.dflash.model import (
    BLOCK_SIZE,
    TARGET_FEATURES,
    DFlashConfigError,
    build_target_layer_ids,
    check_target_layer_ids,
)
from fastdecode.training.feature_config import FeatureConfig, ReportConfig

MODES = ("cache",)


@dataclass
class DFlashFeatures(FeatureConfig):
    """Where the target's features come from: the feature cache of ``fastdecode/training/features.py``
    (``source=generate``: the target's own greedy answers to the training split's first user turns, captured
    while it generates; ``source=data``: teacher-forced on the data's conversations). The same cache serves
    ``recipe=eagle3`` when its settings and exits match."""

    mode: str = "cache"
    source: str = "generate"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise ConfigError(
                f"recipe.features.mode={self.mode}: recipe=dflash reads the feature cache only; set "
                "recipe.features.mode=cache (source=data caches teacher-forced features of data= once)."
            )


@dataclass
class DFlashRecipeConfig:
    name: str = "dflash"
    target_layer_ids: list[int] | None = None  # decoder layers whose outputs are read (null: reference rule)
    num_hidden_layers: int = 1  # the draft's layers
    block_size: int = BLOCK_SIZE  # B: the anchor and B - 1 masks, drafted in one forward
    num_anchors: int = 64  # blocks per sequence per step (the reference's 512 is a GPU value)
    gamma: float = 7.0  # slot k's loss weighs exp(-(k - 1) / gamma) (7 for B = 16)
    loss: str = "ce"  # ce (the sequence's tokens) | kl (the target's distribution) | both (their sum)
    mask_token_id: int | None = None  # null: choose_mask_token (the tokenizer's mask, a spare row, ...)
    speculative_tokens: int | None = None  # drafts per round the exports advertise (null: block_size - 1)
    feature_scale: str = "rms"  # rms: train on features / their channel RMS, folded into fc at export | none
    features: DFlashFeatures = field(default_factory=DFlashFeatures)
    report: ReportConfig = field(default_factory=ReportConfig)

    def __post_init__(self) -> None:
        if self.loss not in KINDS:
            raise unknown_name_error("recipe.loss", self.loss, list(KINDS))
        if self.feature_scale not in SCALES:
            raise unknown_name_error("recipe.feature_scale", self.feature_scale, list(SCALES))
        if self.block_size < 2:
            raise ConfigError(
                f"recipe.block_size={self.block_size}: a block holds its anchor and at least one mask; give >= 2."
            )
        if self.num_hidden_layers < 1 or self.num_anchors < 1:
            raise ConfigError(
                f"recipe.num_hidden_layers={self.num_hidden_layers} and recipe.num_anchors={self.num_anchors} "
                "must be >= 1."
            )
        if not self.gamma > 0:
            raise ConfigError(f"recipe.gamma={self.gamma}: give a positive decay (7 for block_size=16).")
        k = self.speculative_tokens
        if k is not None and not 1 <= k < self.block_size:
            raise ConfigError(
                f"recipe.speculative_tokens={k}: a block of {self.block_size} drafts at most "
                f"{self.block_size - 1}; give 1..{self.block_size - 1}, or null for block_size - 1."
            )

    @property
    def drafts(self) -> int:
        """Drafts per round the exports advertise (``speculative_tokens``, else ``block_size - 1``)."""
        return self.speculative_tokens or self.block_size - 1

    def layer_ids(self, num_layers: int) -> list[int]:
        """The target layers the draft reads (reference convention: id ``i`` = decoder layer ``i``'s output),
        checked here, before the weights load: strictly increasing in ``[0, L - 2]``."""
        try:
            if self.target_layer_ids is None:
                return build_target_layer_ids(num_layers, min(TARGET_FEATURES, max(num_layers - 3, 1)))
            ids = list(self.target_layer_ids)
            check_target_layer_ids(ids, num_layers)
            return ids
        except DFlashConfigError as err:
            raise DFlashConfigError(
                f"recipe.target_layer_ids={self.target_layer_ids if self.target_layer_ids is not None else 'null'}"
                f": {err}"
            ) from err

    def feature_ids(self, num_layers: int) -> list[int]:
        """The cache exits of those layers (``id + 1``: the residual stream after that many blocks)."""
        return [i + 1 for i in self.layer_ids(num_layers)]

    def cached_exits(self, num_layers: int) -> list[int]:
        """The exits the feature cache holds: ``features.exits`` (a superset serves other runs, EAGLE-3's
        too) and the feature layers."""
        return sorted(set(self.features.exits or []) | set(self.feature_ids(num_layers)))

    def validate(self, config: Any) -> None:
        """Every setting against the target's HF ``config`` (read without its weights)."""
        layers = config.num_hidden_layers
        self.layer_ids(layers)
        for e in self.features.exits or []:
            if not 1 <= e < layers:
                raise ConfigError(
                    f"recipe.features.exits has {e} but the target has {layers} layers: cache exits in "
                    f"[1, {layers - 1}]."
                )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < config.vocab_size:
            raise DFlashConfigError(
                f"recipe.mask_token_id={self.mask_token_id} is not a row of the target's embedding "
                f"[0, {config.vocab_size}): give an id below that, or null to choose one."
            )
        if self.report.enabled and self.report.prompts < 1:
            raise ConfigError(
                f"recipe.report.prompts={self.report.prompts}: give >= 1, or recipe.report.enabled=false."
            )
