"""The building blocks of trained drafters, written without any model internals: Llama's RMSNorm as a module,
the rotary tables (``rope_cos_sin``, ``apply_rope``: the half-split, "neox" convention) and the SwiGLU MLP.
EAGLE-3 heads and DFlash blocks (``fastdecode/drafters/``) assemble their layers from them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.config import ConfigError
from fastdecode.runtime.engine import rms_norm


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in fp32 and cast back (Llama's RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> ``[..., dim]`` (``engine.rms_norm``, the project's one RMSNorm)."""
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard Llama rotary tables for ``position_ids [B, T]`` -> ``(cos, sin)``, each
    ``[B, 1, T, head_dim]`` (no scaling variant: ``Eagle3Config`` refuses those)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, T, D]`` by the tables of ``rope_cos_sin`` (the half-split convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: the Llama MLP."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_theta_of(config: Any) -> float:
    """The plain RoPE base of a Hugging Face config (transformers 4's ``rope_theta``/``rope_scaling`` or
    5's ``rope_parameters``); a scaling variant is refused (the drafters support plain RoPE only so far)."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in (None, "default"):
        raise ConfigError(
            f"the target uses rope scaling {kind!r}; fastdecode's trained drafters (EAGLE-3, DFlash) support only plain RoPE so far: "
            "choose a target without rope_scaling"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)
