"""The DFlash draft network (Chen et al., 2026): ``DFlashDraft``, a few Qwen3-style layers (per-head q/k
RMSNorm) whose queries are a block ``[anchor, MASK x (B - 1)]`` and whose keys and values are the context's
fused target features (projected by each layer's own k/v) followed by the block itself, attended without a
causal mask. No embedding and no head: the target's. ``block_mask`` is training's mask over many blocks of one
sequence. Parameter names are the reference checkpoint's (``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.drafters.dflash.model import DFlashConfig
from fastdecode.runtime.draft_layers import RMSNorm, SwiGLU, apply_rope, rope_cos_sin

KV = tuple[torch.Tensor, torch.Tensor]  # keys (rotated) and values, each [B, Hkv, S, D]


class DFlashAttention(nn.Module):
    """Grouped-query attention with q/k RMSNorm per head (Qwen3); no biases."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> KV:
        """``x [B, S, H]`` -> its keys (k_norm, then rotated) and values, ``[B, Hkv, S, D]`` each."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, *rope), v

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context: KV, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [B, Q, H]`` (the block, normed) attends to ``context``'s keys then its own -> ``[B, Q, H]``.
        ``mask``: bool ``[B or 1, 1, Q, S + Q]``, True where a query may attend (None: everything)."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *rope)
        k, v = self.keys_values(x, rope)
        k, v = torch.cat([context[0], k], 2), torch.cat([context[1], v], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose keys and values begin with the context's."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context: KV, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """The drafter (module docstring). ``fuse`` turns the target's features into context vectors,
    ``context_kv`` those into each layer's keys and values, ``forward`` runs a block over them."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.features_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for ``positions [B, T]`` (the draft's own base, ``rope_theta``)."""
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``features [B, S, k * Ht]`` (the target layers' outputs, concatenated in id order) -> context
        vectors ``hidden_norm(fc(features))`` ``[B, S, H]``."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Each layer's keys and values of the context: ``features [B, S, k * Ht]`` at ``positions [B, S]``."""
        ctx = self.fuse(features)
        rope = self.rope(positions, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, rope) for layer in self.layers]

    def forward(
        self,
        noise: torch.Tensor,
        positions: torch.Tensor,
        context: list[KV],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``noise [B, Q, H]`` (the target's embedding of the block's tokens) at ``positions [B, Q]`` over
        ``context`` (``context_kv``, or a decoding cache's keys and values per layer) -> the final-normed
        hidden states ``[B, Q, H]``; the target's head turns them into logits (slot j drafts the token at the
        anchor's position + j). ``mask``: bool ``[B or 1, 1, Q, S + Q]`` (None: every key)."""
        rope = self.rope(positions, noise.dtype)
        h = noise
        for layer, kv in zip(self.layers, context, strict=True):
            h = layer(h, rope, kv, mask)
        return self.norm(h)


def block_mask(anchors: torch.Tensor, keep: torch.Tensor, context: int, block: int) -> torch.Tensor:
    """Training's mask for ``N`` blocks per row: bool ``[B, 1, N * B', S + N * B']`` (``B'`` = ``block``,
    ``S`` = ``context``). Block ``n`` (anchor ``anchors [B, N]``) sees the context strictly before its anchor
    and its own block in both directions, never another block; a padded block (``keep [B, N]`` False) sees
    only itself, its loss weight being zero."""
    batch, n = anchors.shape
    device = anchors.device
    ctx = torch.arange(context, device=device)
    sees_ctx = (ctx[None, None, :] < anchors[..., None]) & keep[..., None]  # [B, N, S]
    sees_ctx = sees_ctx[:, :, None, :].expand(batch, n, block, context).reshape(batch, n * block, context)
    which = torch.arange(n * block, device=device) // block
    own = which[:, None] == which[None, :]  # [N*B', N*B']
    return torch.cat([sees_ctx, own.expand(batch, -1, -1)], -1)[:, None]
