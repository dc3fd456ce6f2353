"""The DFlash drafter's shape (Chen et al., 2026, "DFlash: Block Diffusion for Flash Speculative Decoding"):
``DFlashConfig``, the target layers it reads (``build_target_layer_ids``, the reference rule) and its mask
token (``choose_mask_token``). The module is ``layer.py``'s ``DFlashDraft``; its files are ``files.py``'s.
Layer ids follow the reference (z-lab) convention: id ``i`` is the output of decoder layer ``i``, Hugging
Face's ``hidden_states[i + 1]`` (``feature_ids``). Design notes: docs/design/dflash.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdecode.config import ConfigError
from fastdecode.runtime.draft_layers import rope_theta_of

BLOCK_SIZE = 16  # the reference drafts' block (z-lab "-b16"): an anchor and 15 masks
TARGET_FEATURES = 5  # target layers fused per context token (the reference drafts read 5)


class DFlashConfigError(ConfigError):
    """A DFlash configuration that cannot be built; the message names the setting and the fix."""


def build_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """The reference rule: ``[L // 2]`` for one layer, else ``round(1 + i * (L - 4) / (count - 1))`` for
    ``i < count`` (Python's rounding, half to even: L = 30 gives [1, 8, 14, 20, 27]). Needs L >= 4."""
    if num_target_layers < 4:
        raise DFlashConfigError(
            f"a target of {num_target_layers} layers is too shallow for DFlash's layer rule (needs >= 4): "
            "give target_layer_ids explicitly"
        )
    if count < 1:
        raise DFlashConfigError(f"{count} target layers: give at least 1")
    if count == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count)]


def check_target_layer_ids(ids: Sequence[int], num_target_layers: int) -> None:
    """Ids strictly increasing in ``[0, L - 2]``: layer ``L - 1``'s output is Hugging Face's
    ``hidden_states[L]``, taken after the final norm there and before it by the engines, so never used."""
    ids = list(ids)
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] > num_target_layers - 2:
        raise DFlashConfigError(
            f"target_layer_ids={ids}: give strictly increasing decoder-layer ids in [0, "
            f"{num_target_layers - 2}] for a target of {num_target_layers} layers (id i reads the output of "
            "layer i; the last layer's is refused)"
        )


@dataclass
class DFlashConfig:
    """Everything that shapes a ``DFlashDraft``. The draft has no embedding and no head: it reads the target's
    (frozen), so ``hidden_size`` is the target's and ``vocab_size`` its vocabulary."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    block_size: int = BLOCK_SIZE
    target_hidden_size: int | None = None  # None: hidden_size (set so)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False  # the target's: its head is its embedding
    target_architectures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.target_hidden_size = self.target_hidden_size or self.hidden_size
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        if self.block_size < 2:
            raise DFlashConfigError(f"block_size={self.block_size}: a block needs its anchor and >= 1 mask")
        if self.num_hidden_layers < 1:
            raise DFlashConfigError(f"num_hidden_layers={self.num_hidden_layers}: give at least 1")
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise DFlashConfigError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of num_key_value_heads="
                f"{self.num_key_value_heads}, and head_dim={self.head_dim} even"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DFlashConfigError(
                f"mask_token_id={self.mask_token_id} is not a row of the target's embedding "
                f"[0, {self.vocab_size}): choose one (choose_mask_token)"
            )

    @property
    def feature_ids(self) -> list[int]:
        """Hugging Face ``hidden_states`` indices of the target layers (``id + 1``): what fastdecode's
        verification and feature cache capture, vLLM's and SGLang's capture ids too."""
        return [i + 1 for i in self.target_layer_ids]

    @property
    def features_width(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    @classmethod
    def from_target(
        cls,
        config: Any,
        *,
        mask_token_id: int,
        num_hidden_layers: int = 1,
        target_layer_ids: Sequence[int] | None = None,
        **overrides: Any,
    ) -> DFlashConfig:
        """The drafter for a Hugging Face target ``config``: its width, heads, MLP width, norm epsilon, RoPE
        base and vocabulary; ``target_layer_ids`` default to the reference rule over ``TARGET_FEATURES``
        layers; any field may be overridden by name (an unknown one is refused)."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise DFlashConfigError(f"DFlashConfig has no field(s) {sorted(unknown)}")
        layers, hidden = config.num_hidden_layers, config.hidden_size
        ids = list(target_layer_ids) if target_layer_ids is not None else None
        if ids is None:
            ids = build_target_layer_ids(layers, min(TARGET_FEATURES, max(layers - 3, 1)))
        values: dict[str, Any] = dict(
            hidden_size=hidden,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or hidden // config.num_attention_heads,
            # the MLP width by the family's name for it (OPT: ffn_dim), else 4x the width
            intermediate_size=getattr(config, "intermediate_size", None)
            or getattr(config, "ffn_dim", None)
            or 4 * hidden,
            vocab_size=config.vocab_size,
            target_layer_ids=ids,
            num_target_layers=layers,
            mask_token_id=mask_token_id,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta_of(config),
            max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            target_architectures=list(getattr(config, "architectures", None) or []),
        )
        return cls(**{**values, **overrides})


def choose_mask_token(tokenizer: Any, embedding_rows: int, explicit: int | None = None) -> tuple[int, str]:
    """The mask token's id and why it was chosen: ``explicit`` (checked to be a row), else the tokenizer's
    mask token, else a spare embedding row past the tokenizer (no text ever holds it), else the first special
    token the text never holds (an added special token that is not BOS/EOS/PAD/UNK nor in the chat template).
    None fits: refused naming the setting. Decoding never filters outputs by this id (a value-based cleanup
    deleted real tokens in a reference implementation), so any row works; an unused one keeps the trained
    mask embedding apart from every real token's."""
    if explicit is not None:
        if not 0 <= explicit < embedding_rows:
            raise DFlashConfigError(
                f"mask_token_id={explicit} is not a row of the target's embedding [0, {embedding_rows}): "
                "give an id below that, or null to choose one"
            )
        return explicit, "given"
    mask = getattr(tokenizer, "mask_token_id", None)
    if mask is not None and 0 <= mask < embedding_rows:
        return int(mask), "the tokenizer's mask token"
    if len(tokenizer) < embedding_rows:
        return len(tokenizer), "a spare embedding row after the tokenizer's vocabulary"
    used = {
        getattr(tokenizer, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    }
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else " ".join(map(str, template))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for token_id in sorted(added):
        token = added[token_id]
        if getattr(token, "special", False) and token_id not in used and str(token) not in template:
            if 0 <= token_id < embedding_rows:
                return int(token_id), f"the unused special token {str(token)!r}"
    raise DFlashConfigError(
        "no safe DFlash mask token: the tokenizer has no mask token, its vocabulary fills all "
        f"{embedding_rows} embedding rows, and every special token is one text uses (BOS/EOS/PAD/UNK or the "
        "chat template's): give recipe.mask_token_id=ID, a token your data never contains"
    )
