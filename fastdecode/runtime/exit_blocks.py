"""Exit-adapter blocks (Kangaroo; ``fastdecode/drafters/exits/adapter.py``) built from a family's decoder layers.

Part of the model seam (with ``model.py``, ``families.py`` and ``engine_build.py``): the only code that copies
a HF decoder layer and calls its self-attention on its own. ``EarlyExitModel.adapter_block`` calls
``exit_block``; adding an exit adapter kind is a branch here and its name in ``KINDS``.

Layers are copied here for a reason: an exit adapter is a *trainable* copy of one layer (deep copy,
``requires_grad`` on), so training it never touches the model's own layers.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.families import Family, submodule

KINDS = ("block", "attention")  # exit adapter kinds (fastdecode.drafters.exits.adapter, recipe.kind)


def exit_block(
    layer: nn.Module, family: Family, kind: str, slot: int, *, zero_residual: bool = False
) -> nn.Module:
    """A trainable copy of the decoder ``layer`` (of ``family``) whose attention keeps its KV in cache layer
    ``slot``.

    ``kind="block"``: the whole decoder layer. ``kind="attention"``: Kangaroo's adapter (Liu et al., 2024),
    the layer's pre-attention norm and self-attention with its residual, then a second norm of the same
    type (weight 1, bias 0: at initialisation it changes nothing, since the shared final norm follows).
    ``zero_residual``: zero the projections that write into the residual stream (``Family.residual_writers``),
    so the block starts as the identity (the drafter starts as the raw exit) and learns a correction.
    """
    if kind not in KINDS:
        raise unknown_name_error("exit adapter kind", kind, list(KINDS))
    layer = copy.deepcopy(layer)
    for module in layer.modules():
        if hasattr(module, "layer_idx"):
            module.layer_idx = slot
    if zero_residual:
        with torch.no_grad():
            for path in family.residual_writers:
                for param in submodule(layer, path).parameters():
                    param.zero_()
    block = layer if kind == "block" else _attention_block(layer, family)
    return block.requires_grad_(True)


def _attention_block(layer: nn.Module, family: Family) -> AttentionBlock:
    if getattr(layer, "do_layer_norm_before", True) is False:
        raise ConfigError(
            "the 'attention' exit adapter needs a pre-norm model (this one normalises after "
            "attention, do_layer_norm_before=False); use the 'block' adapter kind."
        )
    norm = submodule(layer, family.attn_norm)
    out_norm = copy.deepcopy(norm)
    with torch.no_grad():
        for name, param in out_norm.named_parameters():
            param.fill_(1.0 if name == "weight" else 0.0)
    return AttentionBlock(norm, layer.self_attn, out_norm)


class AttentionBlock(nn.Module):
    """Kangaroo's exit adapter: ``out_norm(h + self_attn(norm(h)))`` with a Hugging Face attention module."""

    def __init__(self, norm: nn.Module, self_attn: nn.Module, out_norm: nn.Module) -> None:
        super().__init__()
        self.norm, self.self_attn, self.out_norm = norm, self_attn, out_norm

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        use_cache: bool = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``hidden [B, T, H]`` -> ``[B, T, H]``."""
        kwargs = {"position_embeddings": position_embeddings} if position_embeddings is not None else {}
        out, _ = self.self_attn(
            hidden_states=self.norm(hidden),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            **kwargs,
        )
        return self.out_norm(hidden + out)
