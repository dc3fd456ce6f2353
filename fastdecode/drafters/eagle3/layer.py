"""The parts of an EAGLE-3 head (Li et al., 2025), written here so that the head needs no model internals.

The head's keys and values for training (``Eagle3KV``; decoding passes a one-layer ``KVCache`` instead), the attention masks (``causal_mask``, the training-time test's ``ttt_mask``)
and the head's one decoder layer (``Eagle3Layer``), whose q/k/v projections read ``2H`` inputs. ``model.py``
assembles them. Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.draft_layers import RMSNorm, SwiGLU, apply_rope


@dataclass
class Eagle3KV:
    """The head's keys and values so far, as blocks in the order they were written.

    ``keys[i]``/``values[i]``: ``[B, num_key_value_heads, S_i, head_dim]``, keys already rotated. A forward
    appends one block per call (``update``: the protocol of ``fastdecode.runtime.cache.KVCache``, which decoding
    passes instead: preallocated, rolled back by a length pointer); ``len(kv)`` is the total ``S``.
    ``crop(n)`` keeps the first ``n`` positions (a rollback after a verification rejected the rest).
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(k.shape[2] for k in self.keys)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` ``[B, Hkv, T, D]``; return every key and value so far, ``[B, Hkv, S, D]``."""
        self.keys.append(k)
        self.values.append(v)
        return self.concatenated()

    def concatenated(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(K, V)``, each ``[B, Hkv, S, D]``, or None while empty."""
        if not self.keys:
            return None
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (``0 <= length <= len(self)``)."""
        if not 0 <= length <= len(self):
            raise ValueError(f"cannot crop {len(self)} cached positions to {length}")
        both = self.concatenated()
        if both is None or length == len(self):
            return
        self.keys, self.values = [both[0][:, :, :length]], [both[1][:, :, :length]]


def causal_mask(new: int, past: int, device: torch.device | None = None) -> torch.Tensor:
    """bool ``[new, past + new]``: every past key, and the new keys up to the query's own position."""
    cols = torch.arange(past + new, device=device)
    rows = torch.arange(new, device=device)[:, None]
    return cols[None, :] <= rows + past


def ttt_mask(length: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """The training-time test mask of unroll step ``step`` over sequences of ``length`` positions.

    bool ``[length, (step + 1) * length]``, keys being the blocks written at steps ``0..step`` (each
    ``length`` long, in that order): the block of step 0 causally (position ``t`` sees ``t' <= t``), every
    later block only at ``t`` itself (the chain of the head's own earlier guesses for that position).
    Packed sequences AND block 0 with their document mask.
    """
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal_mask(length, 0, device), *([eye] * step)], dim=1)


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose q/k/v read ``2H`` inputs; no biases."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: Eagle3KV | KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [B, T, 2H]`` -> ``[B, T, H]``. The T new positions attend to every key already in ``kv`` and
        causally to each other, unless ``attn_mask`` (bool ``[T, S + T]`` or ``[B, 1, T, S + T]``, True where
        a query may attend, over ``cat(kv keys, new keys)``) says otherwise; the new keys and values are
        appended to ``kv`` when one is given."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv is not None:
            k, v = kv.update(k, v, 0)
        if attn_mask is None:
            attn_mask = causal_mask(t, k.shape[2] - t, x.device)
        if attn_mask.shape[-2:] != (t, k.shape[2]):
            raise ValueError(f"attn_mask {tuple(attn_mask.shape)} does not end in [{t}, {k.shape[2]}]")
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Eagle3Layer(nn.Module):
    """The head's one decoder layer: a Llama layer whose q/k/v projections read
    ``cat([input_layernorm(embedding), hidden_norm(fused)])`` and whose residual stream starts from the fused
    feature (normed with ``norm_before_residual``, raw otherwise)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        *,
        eps: float,
        norm_before_residual: bool,
    ) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Eagle3Attention(hidden, heads, kv_heads, head_dim)
        self.mlp = SwiGLU(hidden, intermediate)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: Eagle3KV | KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``embeds [B, T, H]``, ``hidden [B, T, H]`` (fused feature or the head's own output) -> the
        residual stream after the layer, ``[B, T, H]`` (before the head's final norm)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = residual + self.self_attn(x, rope, kv, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))
