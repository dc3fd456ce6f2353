"""``configs/recipe/exit_adapter.yaml`` as typed dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.drafters.exits.adapter import INITS, KINDS, check_exit_layer
from fastdecode.training.feature_config import FeatureConfig

TARGETS = ("topk", "full")


@dataclass
class LossConfig:
    """Distillation toward the final layer (KL) plus optional cross-entropy on the data's labels.

    ``target``: ``topk`` = the teacher's top-k log-probabilities cached with the features (renormalised over
    the k; over the draft vocabulary, the ones in it); ``full`` = the teacher's whole distribution over the
    drafter's head rows, recomputed from the cached final hidden state (its softmax over the draft vocabulary
    is exactly the full distribution restricted and renormalised).
    """

    target: str = "topk"
    temperature: float = 1.0  # of the teacher and the student, as in the usual distillation loss
    kl_weight: float = 1.0
    ce_weight: float = 0.0  # cross-entropy on the next token of the data (labels outside the head: skipped)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise unknown_name_error("recipe.loss.target", self.target, list(TARGETS))
        if self.temperature <= 0:
            raise ConfigError(f"recipe.loss.temperature={self.temperature}: must be > 0.")
        if self.kl_weight < 0 or self.ce_weight < 0 or self.kl_weight + self.ce_weight == 0:
            raise ConfigError("recipe.loss.kl_weight and ce_weight must be >= 0 and not both 0.")


@dataclass
class ReportConfig:
    """Per-exit agreement on the model's own greedy generations (= greedy draft acceptance), then a speed line."""

    enabled: bool = True
    prompts: int = 16  # held-out prompts the model continues greedily (cached with the features)
    max_new_tokens: int = 64
    held_out_examples: int = 16  # held-out conversations for the base model's perplexity (before and after)
    max_draft: int = 8
    data: str | None = None  # held-out set: null = the training data's; or a data config name
    speed_prompts: int = (
        4  # closing speed line: self-speculation through the chosen adapter vs autoregressive
    )
    speed_new_tokens: int = 32
    min_speedup: float = 1.05  # an exit is "chosen" only if the cost model expects at least this


@dataclass
class ExitAdapterConfig:
    name: str = "exit_adapter"
    exits: list[int] = field(default_factory=lambda: [4, 8])  # E (blocks run); one adapter each
    kind: str = "block"  # block | attention
    init: str = "last"  # last | exit: the block is copied from the last layer or from layer E
    zero_init: bool = False  # zero its residual-writing projections: it starts as the raw exit
    draft_vocab_size: int | None = (
        8192  # train and draft over the most frequent trained-on tokens (null: all)
    )
    draft_vocab: str | None = None  # an existing draft_vocab.json instead (e.g. a LayerSkip checkpoint's)
    loss: LossConfig = field(default_factory=LossConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)
    report: ReportConfig = field(default_factory=ReportConfig)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise unknown_name_error("recipe.kind", self.kind, list(KINDS))
        if self.init not in INITS:
            raise unknown_name_error("recipe.init", self.init, list(INITS))
        if not self.exits:
            raise ConfigError("recipe.exits is empty: give at least one exit E (blocks run).")
        if len(set(self.exits)) != len(self.exits):
            raise ConfigError(f"recipe.exits={self.exits} repeats an exit.")

    def cached_exits(self) -> list[int]:
        return sorted(set(self.features.exits or self.exits) | set(self.exits))

    def validate(self, num_layers: int) -> None:
        """Every exit against the model (ExitLayerError), before any data or training work."""
        for exit_layer in self.cached_exits():
            key = "recipe.exits" if exit_layer in self.exits else "recipe.features.exits"
            check_exit_layer(exit_layer, num_layers, key)
