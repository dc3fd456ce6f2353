"""``configs/recipe/layerskip.yaml`` as typed dataclasses (torchtune's key names, so LayerSkip users feel at home).

Layer indices are 0-based blocks: "exit after block l". The recommended exit ``E`` written into
``fastdecode.json`` (and, opted in, ``generation_config.assistant_early_exit``) counts blocks run
(``E = l + 1``), as Hugging Face's does; the logs name exits by E too (``loss/exit_E``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdecode.config import ConfigError, unknown_name_error
from layerskip_train.early_exit_loss import CURRICULA, CURRICULUM_ALIASES, SelfDistill


@dataclass
class EarlyExitLossConfig:
    layers: str | list[int] | None = ":"  # candidate exits (slice syntax over blocks); the last is always on
    curriculum: str = "strided"  # none | rotational (torchtune's; alias rot) | strided (ours) | gradual
    stride: int = 4  # R of the strided curriculum (read by no other curriculum)
    scale_fn: str = "uniform"  # uniform | linear_l | sum_l | sqrt_l | inv_l | inv_sqrt_l
    scale: float = 1.0  # e_scale: multiplies every non-final exit's weight
    chunk_size: int = 1024  # label tokens per recomputed head+CE chunk
    token_fraction: float = 1.0  # non-final exits score this random fraction of label tokens (unbiased)
    distill: float = 0.0  # self-distillation weight of the non-final exits (0: label CE only)
    distill_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.curriculum not in CURRICULA and self.curriculum not in CURRICULUM_ALIASES:
            raise unknown_name_error("curriculum", self.curriculum, list(CURRICULA))
        if not 0.0 < self.token_fraction <= 1.0:
            raise ConfigError(
                f"recipe.early_exit_loss.token_fraction must be in (0, 1], got {self.token_fraction}."
            )
        if self.stride < 1:
            raise ConfigError(f"recipe.early_exit_loss.stride must be >= 1, got {self.stride}.")

    def self_distill(self) -> SelfDistill | None:
        return SelfDistill(self.distill, self.distill_temperature) if self.distill > 0 else None


@dataclass
class LayerDropoutConfig:
    prob: float = 0.1  # p_max: the rate of the deepest selected layer
    layers: str | list[int] | None = ":"
    layers_scale: str = "exp"  # exp | linear | uniform (depth scale D(l))
    time_scale: str = "constant"  # constant (fine-tuning) | exp (pre-training from scratch)

    def __post_init__(self) -> None:
        if not 0.0 <= self.prob < 1.0:
            raise ConfigError(
                f"recipe.layer_dropout.prob must be in [0, 1), got {self.prob} (0.1-0.2 in the paper)."
            )


@dataclass
class ReportConfig:
    """The per-exit quality report written at the start and end of training."""

    enabled: bool = True
    before: bool = True  # also measure the model before training (skip it when sweeping configurations)
    prompts: int = 16  # held-out prompts the model continues greedily (draft acceptance on own generations)
    max_new_tokens: int = 64
    held_out_examples: int = 32  # held-out examples for per-exit perplexity and agreement
    max_draft: int = 8  # largest draft length considered when choosing the recommended exit
    # Held-out set of the report: null = the training data's held-out split; a data config name (e.g.
    # sharegpt) when training on generated data, so perplexity is measured on real answers.
    data: str | None = None
    # The closing speed line: self-speculation at the chosen (or best-found) exit vs autoregressive decoding on
    # this many held-out prompts (0: no speed line).
    speed_prompts: int = 4
    speed_new_tokens: int = 32


@dataclass
class ExportConfig:
    """What the exported checkpoint records beyond its weights.

    ``hf_assistant_early_exit``: also write E into ``generation_config.assistant_early_exit``, so plain
    ``generate()`` self-speculates by default. Off by default because transformers then refuses every batch
    larger than one ("assisted generate is only supported for batch_size = 1", in ``pipeline`` too) and, on
    long prompts, nests a second assisted generation; E is always in ``fastdecode.json``.
    """

    hf_assistant_early_exit: bool = False


@dataclass
class LayerSkipConfig:
    """``early_exit_loss: null`` trains no exit but the last (plain SFT loss); ``layer_dropout: null`` drops
    no layer. Both mean off, as in torchtune, not "the defaults"."""

    name: str = "layerskip"
    early_exit_loss: EarlyExitLossConfig | None = field(default_factory=EarlyExitLossConfig)
    layer_dropout: LayerDropoutConfig | None = field(default_factory=LayerDropoutConfig)
    exit_layer: int | None = None  # E recorded in fastdecode.json; None: chosen from the exit report
    export: ExportConfig = field(default_factory=ExportConfig)
    touch_skipped_layers: bool = True  # keep every parameter in the graph (DDP/ZeRO need it)
    report: ReportConfig = field(default_factory=ReportConfig)
    # Size of the frequency-ranked draft vocabulary written next to the checkpoint (draft_vocab.json, from the
    # trained-on tokens): drafting then scores only these head rows. null or >= the vocabulary: not written.
    draft_vocab_size: int | None = 8192

    def __post_init__(self) -> None:
        if self.early_exit_loss is None:  # off: no candidate exit; the last layer is always trained
            self.early_exit_loss = EarlyExitLossConfig(layers=[], curriculum="none")
        if self.layer_dropout is None:  # off: rate 0 everywhere
            self.layer_dropout = LayerDropoutConfig(prob=0.0)
