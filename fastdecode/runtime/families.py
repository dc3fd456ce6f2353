"""The model families: where each Hugging Face family keeps the parts ``EarlyExitModel`` runs.

One ``Family`` per HF ``config.model_type`` in ``FAMILIES``: attribute paths from the ``*ForCausalLM`` object,
the projections that write into the residual stream, and whether the engine's lean ``RotaryLayer`` may run
the family's layers (``lean``). Adding a family: docs/design/runtime.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from fastdecode.config import unknown_name_error


@dataclass(frozen=True)
class Family:
    """Where a model family keeps its parts (attribute paths from the ``*ForCausalLM`` object)."""

    backbone: str  # module holding the parts below, e.g. "model" or "model.decoder"
    embed_tokens: str = "embed_tokens"
    layers: str = "layers"
    final_norm: str | None = "norm"
    rotary: str | None = "rotary_emb"  # rotary embedding module; None for learned positions
    embed_positions: str | None = None  # learned absolute positions (OPT)
    project_in: str | None = None  # optional projections (OPT-350m)
    project_out: str | None = None
    attn_norm: str = "input_layernorm"  # a decoder layer's norm before its self-attention (exit adapters)
    residual_writers: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")  # project into the residual
    lean: bool = False  # pre-norm rotary layers with SiLU-gated MLPs: the engine's RotaryLayer may run them


ROTARY_DECODER = Family(backbone="model", lean=True)
FAMILIES: dict[str, Family] = {
    "llama": ROTARY_DECODER,  # Llama 2/3, CodeLlama, SmolLM2, LayerSkip checkpoints
    "mistral": ROTARY_DECODER,
    "qwen2": ROTARY_DECODER,
    "opt": Family(
        backbone="model.decoder",
        final_norm="final_layer_norm",
        rotary=None,
        embed_positions="embed_positions",
        project_in="project_in",
        project_out="project_out",
        attn_norm="self_attn_layer_norm",
        residual_writers=("self_attn.out_proj", "fc2"),
    ),
}


def family_of(model_type: str) -> Family:
    """The registered family of HF's ``config.model_type``; an unknown one raises a ``ConfigError`` listing
    the registered families."""
    if model_type not in FAMILIES:
        raise unknown_name_error(
            "model family",
            model_type,
            list(FAMILIES),
            "Add it in fastdecode/runtime/families.py (see its docstring).",
        )
    return FAMILIES[model_type]


def kv_geometry(config: PretrainedConfig) -> tuple[int, int]:
    """(number of KV heads, head dim) of every layer of a model with HF config ``config``."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def submodule(module: nn.Module, path: str | None) -> nn.Module | None:
    """The submodule at the dotted attribute ``path`` of ``module`` (None: no path, or a part missing)."""
    if path is None:
        return None
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module
