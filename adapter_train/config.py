"""``configs/recipe/exit_adapter.yaml`` as typed dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.exit_adapter import INITS, KINDS, check_exit_layer

TARGETS = ("topk", "full")
FEATURE_DTYPES = ("float32", "bfloat16", "float16")


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

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise unknown_name_error("recipe.features.source", self.source, list(SOURCES))
        if self.max_new_tokens < 1 or self.max_prompt_tokens < 1:
            raise ConfigError("recipe.features.max_new_tokens and max_prompt_tokens must be >= 1.")
        if self.dtype not in FEATURE_DTYPES:
            raise unknown_name_error("recipe.features.dtype", self.dtype, list(FEATURE_DTYPES))
        if self.top_k < 1 or self.batch_size < 1:
            raise ConfigError("recipe.features.top_k and batch_size must be >= 1.")
        if self.shard_records < 1 or self.shard_records % self.batch_size:
            raise ConfigError(
                f"recipe.features.shard_records={self.shard_records} must be a positive multiple of "
                f"batch_size={self.batch_size} (a resumed run then batches exactly like an uninterrupted one)."
            )

    def record_bytes(self, positions: int, scored: int, *, exits: int, hidden: int) -> int:
        """Bytes of one cached record (``adapter_train/features.py``'s fields) of a sequence of ``positions``
        tokens with ``scored`` trained positions, for ``exits`` exits and hidden size ``hidden``: ids and
        positions int32, hidden states at ``dtype``, top-k ids int32 and log-probabilities float32, plus the
        index and the per-field offsets (int64) of the shard."""
        width = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        per_position = 4 + exits * hidden * width  # input_ids, h<E>
        per_scored = 3 * 4 + self.top_k * (4 + 4) + hidden * width  # scored/targets/teacher, top-k, final
        return positions * per_position + scored * per_scored + 8 * (1 + 7 + exits)


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
