"""The EAGLE-3 draft head (Li et al., 2025, "Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"): ``Eagle3Config``, ``Eagle3Head`` and the draft vocabulary maps (``vocab_maps``).

Per position the head fuses three of the target's hidden states (``fuse``), mixes them with the target's
embedding of a token in one decoder layer (``layer.py``) and scores a draft vocabulary (``d2t``, ``t2d``).
Its files are ``files.py``'s. Only plain RoPE is supported: a target with rope scaling is refused.
Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fastdecode.config import ConfigError
from fastdecode.drafters.eagle3.layer import Eagle3KV, Eagle3Layer
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.draft_layers import RMSNorm, rope_cos_sin, rope_theta_of

FEATURES = 3  # target hidden states the head reads per position (low, middle, high)
# The one default of ``norm_before_residual`` (the head's and ``recipe=eagle3``'s): false, EAGLE-3's layer,
# the only one SGLang runs and the one vLLM runs when the file says so (``files.py`` always writes the key).
NORM_BEFORE_RESIDUAL = False


class Eagle3ConfigError(ConfigError):
    """An EAGLE-3 head configuration that cannot be built; the message names the setting and the fix."""


def default_aux_layers(num_layers: int) -> list[int]:
    """The feature layers vLLM and speculators default to for a target of ``num_layers`` layers:
    ``[2, L // 2, L - 3]`` (hidden-state indices; 0 is the embedding output). Below 7 layers those ids
    repeat or run backwards (``[2, 2, 1]`` at L = 4): refused, so a tiny target names its ids."""
    ids = [2, num_layers // 2, num_layers - 3]
    if not ids[0] < ids[1] < ids[2]:
        raise Eagle3ConfigError(
            f"a target of {num_layers} layers has no three distinct default EAGLE-3 feature layers "
            f"(the rule [2, L // 2, L - 3] gives {ids}): give aux_layer_ids explicitly (ids in "
            f"[0, {num_layers - 1}], hidden_states[i])"
        )
    return ids


def check_aux_layer_ids(ids: Sequence[int], num_layers: int) -> None:
    """Refuse feature ids a target of ``num_layers`` (L) layers does not have, before any weights load.

    Id ``i`` is Hugging Face's ``hidden_states[i]``: the residual stream entering block ``i``, ``0 <= i < L``
    (0: the embedding output). Every runtime reads those alike: vLLM captures id ``i`` before layer ``i``,
    SGLang before layer ``k + 1`` of its id ``k = i - 1`` (``files.sglang_layer_ids``), fastdecode's
    verification (``speculative.run_capturing``) and the training features after ``i`` blocks. ``L`` is
    refused: there Hugging Face and fastdecode's capture read the stream after the final norm, vLLM before it,
    SGLang nothing, so one id would mean three features."""
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise Eagle3ConfigError(
            f"aux_layer_ids={list(ids)}: {bad} out of range; a target of {num_layers} layers has feature ids "
            f"in [0, {num_layers - 1}] (hidden_states[i], the residual stream entering block i)"
        )


@dataclass
class Eagle3Config:
    """Everything that shapes an ``Eagle3Head`` (``hidden_size`` H, ``target_hidden_size`` Ht)."""

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: list[int]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_before_residual: bool = NORM_BEFORE_RESIDUAL
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per feature before fc
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc
    target_architectures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.fc_norm and self.norm_before_fc:
            raise Eagle3ConfigError(
                "fc_norm and norm_before_fc are mutually exclusive (per-feature norms vs one norm over the "
                "concatenation): set one of them to false"
            )
        if len(self.aux_layer_ids) != FEATURES:
            raise Eagle3ConfigError(f"aux_layer_ids={self.aux_layer_ids}: give exactly {FEATURES} layer ids")
        if any(i < 0 for i in self.aux_layer_ids):  # the upper bound needs the target: check_aux_layer_ids
            raise Eagle3ConfigError(
                f"aux_layer_ids={self.aux_layer_ids}: feature ids are hidden_states indices in [0, L - 1] "
                "for a target of L layers (0: the embedding output)"
            )
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise Eagle3ConfigError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of num_key_value_heads="
                f"{self.num_key_value_heads}, and head_dim={self.head_dim} even"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise Eagle3ConfigError(
                f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]"
            )
        if FEATURES * self.target_hidden_size == self.hidden_size:
            raise Eagle3ConfigError(
                f"hidden_size={self.hidden_size} equals 3 * target_hidden_size: the head could not tell "
                "features from a fused hidden state; choose another hidden_size"
            )

    @classmethod
    def from_target(
        cls,
        config: Any,
        *,
        draft_vocab_size: int,
        aux_layer_ids: Sequence[int] | None = None,
        **overrides: Any,
    ) -> Eagle3Config:
        """The head for a Hugging Face target ``config``: its widths, heads, norm epsilon, RoPE base and
        vocabulary; ``aux_layer_ids`` default to ``default_aux_layers(config.num_hidden_layers)`` and are
        checked against the target (``check_aux_layer_ids``); any field may be overridden by name (an unknown
        one is refused)."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise Eagle3ConfigError(f"Eagle3Config has no field(s) {sorted(unknown)}")
        hidden = config.hidden_size
        layers = config.num_hidden_layers
        ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layers(layers)
        check_aux_layer_ids(ids, layers)
        values: dict[str, Any] = dict(
            hidden_size=hidden,
            target_hidden_size=hidden,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or hidden // config.num_attention_heads,
            intermediate_size=getattr(config, "intermediate_size", None) or config.ffn_dim,  # OPT: ffn_dim
            vocab_size=config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=ids,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-5),
            rope_theta=rope_theta_of(config),
            max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
            target_architectures=list(getattr(config, "architectures", None) or []),
        )
        return cls(**{**values, **overrides})


def vocab_maps(
    target_ids: Sequence[int] | torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [S] int64 offsets, t2d [vocab_size] bool)`` for a draft vocabulary of the distinct
    ``target_ids``; draft id ``i`` is the ``i``-th smallest target id (as speculators and SpecForge build them)."""
    ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
    if ids.numel() == 0 or ids.unique().numel() != ids.numel() or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be distinct and in [0, {vocab_size})")
    ids = ids.sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def vocab_maps_agree(d2t: torch.Tensor, t2d: torch.Tensor) -> bool:
    """Whether ``d2t [S]`` and ``t2d [V]`` describe the same ``S`` distinct target ids."""
    targets = torch.arange(d2t.numel()) + d2t.long().cpu()
    t2d = t2d.bool().cpu()
    if targets.numel() == 0 or targets.min() < 0 or targets.max() >= t2d.numel():
        return False
    return (
        targets.unique().numel() == targets.numel()
        and bool(t2d[targets].all())
        and int(t2d.sum()) == targets.numel()
    )


class Eagle3Head(nn.Module):
    """The EAGLE-3 head (module docstring). Parameter and buffer names are the speculators checkpoint's:
    ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (and ``fc_norm.{0,1,2}`` or
    ``input_norm`` when those options are on)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        ht, eps = cfg.target_hidden_size, cfg.rms_norm_eps
        self.input_norm = RMSNorm(FEATURES * ht, eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(ht, eps) for _ in range(FEATURES)) if cfg.fc_norm else None
        self.fc = nn.Linear(FEATURES * ht, cfg.hidden_size, bias=False)
        layer = Eagle3Layer(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            eps=eps,
            norm_before_residual=cfg.norm_before_residual,
        )
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(cfg.hidden_size, eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        d2t, t2d = vocab_maps(range(cfg.draft_vocab_size), cfg.vocab_size)  # the first ids until set
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    def set_draft_vocab(self, target_ids: Sequence[int] | torch.Tensor) -> None:
        """Score the distinct ``target_ids`` (``draft_vocab_size`` of them): fills ``d2t`` and ``t2d``."""
        if len(target_ids) != self.config.draft_vocab_size:
            raise ValueError(
                f"{len(target_ids)} ids for a draft vocabulary of {self.config.draft_vocab_size}"
            )
        d2t, t2d = vocab_maps(target_ids, self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape) -> the target's ids (same shape)."""
        return ids + self.d2t[ids]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``features [B, T, 3 * Ht]`` (the ``aux_layer_ids`` hidden states, concatenated in that order)
        -> the fused feature ``[B, T, H]``."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            parts = features.chunk(FEATURES, dim=-1)
            features = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts, strict=True)], dim=-1)
        return self.fc(features)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        kv: Eagle3KV | KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the head over ``T`` positions -> ``(logits [B, T, draft_vocab_size], hidden [B, T, H])``.

        ``embeds [B, T, H]``: the target's embedding of each position's token. ``hidden``: either the
        target's features ``[B, T, 3 * Ht]`` (fused here) or a fused feature / the head's own earlier output
        hidden ``[B, T, H]``. ``position_ids [B, T]``: the RoPE positions (the caller's convention; the
        trainer and the proposer must agree). ``kv``: the keys and values of earlier calls, extended with
        this call's (``Eagle3KV``, or a one-layer ``KVCache`` when decoding); ``attn_mask``: bool
        ``[T, S + T]`` or ``[B, 1, T, S + T]``, True where a query may attend (default: all ``S`` cached keys and causal among the new ones; see
        ``fastdecode/drafters/eagle3/layer.py``). The returned ``hidden`` is the layer's output before the final
        norm: what the next draft step feeds back.
        """
        cfg = self.config
        if hidden.shape[-1] == FEATURES * cfg.target_hidden_size:
            hidden = self.fuse(hidden)
        if hidden.shape[-1] != cfg.hidden_size or embeds.shape[-1] != cfg.hidden_size:
            raise ValueError(
                f"hidden {tuple(hidden.shape)} / embeds {tuple(embeds.shape)}: expected last dims "
                f"{FEATURES * cfg.target_hidden_size} or {cfg.hidden_size} / {cfg.hidden_size}"
            )
        rope = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, embeds.dtype)
        out = self.layers[0](embeds, hidden, rope, kv, attn_mask)
        return self.lm_head(self.norm(out)), out
