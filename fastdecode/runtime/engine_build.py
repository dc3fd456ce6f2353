"""Building the decoding engine (``fastdecode/runtime/engine.py``) from a model's Hugging Face modules.

Part of the model seam (with ``model.py``, ``families.py`` and ``exit_blocks.py``): the only code that reads
a HF decoder layer's submodules to build the engine. ``EarlyExitModel.use_engine`` calls ``build_engine``.
Layers the lean ``RotaryLayer`` does not serve get an inference copy (``fast_linear.packed_copy``,
parameters shared), so the model that trains is never touched (docs/design/runtime.md).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from fastdecode.runtime.engine import Engine, EngineOptions, RotaryLayer
from fastdecode.runtime.families import Family, kv_geometry
from fastdecode.runtime.fast_linear import FastLinear, packed_copy
from fastdecode.runtime.weights import linear_maker

LEAN_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")
LEAN_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
LEAN_NORMS = ("input_layernorm", "post_attention_layernorm")


def _lean_layer_layout(layer: nn.Module, head_dim: int) -> bool:
    """Whether one HF decoder layer has exactly the parts ``RotaryLayer`` computes."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not all(hasattr(attn, a) for a in LEAN_ATTENTION_PARTS):
        return False
    if not all(isinstance(getattr(mlp, a, None), nn.Linear) for a in LEAN_MLP_PARTS):
        return False
    if not all(hasattr(getattr(layer, norm, None), "variance_epsilon") for norm in LEAN_NORMS):
        return False
    if len(list(layer.children())) != 4 or len(list(attn.children())) != 4:
        return False  # extra submodules (e.g. q/k norms): not the layout RotaryLayer computes
    return attn.head_dim == head_dim


def lean_supported(
    config: PretrainedConfig,
    family: Family,
    layers: Sequence[nn.Module],
    *,
    final_norm: nn.Module | None,
    rotary: nn.Module | None,
) -> bool:
    """Whether ``RotaryLayer`` reproduces these layers (family, activation, module layout)."""
    if not family.lean or getattr(config, "hidden_act", None) != "silu":
        return False
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0 or rotary is None:
        return False
    if final_norm is None or not hasattr(final_norm, "variance_epsilon"):
        return False
    head_dim = kv_geometry(config)[1]
    return all(_lean_layer_layout(layer, head_dim) for layer in layers)


def _lean_layers(
    config: PretrainedConfig, layers: Sequence[nn.Module], make: Callable[[Sequence[nn.Linear]], nn.Module]
) -> list[RotaryLayer]:
    """One ``RotaryLayer`` per HF layer, over fused products of its projections (``make``)."""
    heads = config.num_attention_heads
    kv_heads, head_dim = kv_geometry(config)
    lean = []
    for index, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        norms = tuple(
            (norm.weight, norm.variance_epsilon)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm)
        )
        lean.append(
            RotaryLayer(
                index,
                norms,
                make([attn.q_proj, attn.k_proj, attn.v_proj]),
                make([attn.o_proj]),
                make([mlp.gate_proj, mlp.up_proj]),
                make([mlp.down_proj]),
                heads,
                kv_heads,
                head_dim,
                attn.scaling,
            )
        )
    return lean


def build_engine(
    model: nn.Module,
    layers: Sequence[nn.Module],
    options: EngineOptions,
    *,
    lean: bool,
    final_norm: nn.Module | None,
) -> Engine:
    """The engine ``options`` describe for the HF causal LM ``model`` with decoder ``layers``: lean layers
    when ``lean`` (``lean_supported`` and ``options.fast_layers``), else packed inference copies
    (``options.fast_linear``) or the HF layers themselves; a packed head with ``fast_linear``. Kernel plans
    are calibrated on the model's own weights; the parameters' versions are recorded (``Engine.stale``).
    4-bit or 8-bit ``options.weights``: every projection and the head read them (``runtime/weights.py``)."""
    start = time.perf_counter()
    groups: dict[str, list[FastLinear]] = defaultdict(list)
    quantised = options.weights.kind != "fp32"
    make = linear_maker(options.weights, model.get_output_embeddings().weight.device)
    norm = None
    if lean:
        run = _lean_layers(model.config, layers, make)
        for layer in run:
            layer.invariant = quantised  # bf16 products: verification bitwise as decoding (engine.py)
            for name, lin in layer.linears().items():
                if isinstance(lin, FastLinear):
                    groups[name].append(lin)
        norm = (final_norm.weight.detach(), final_norm.variance_epsilon)
    elif options.fast_linear or quantised:
        run = [packed_copy(layer, groups, make) for layer in layers]
    else:
        run = list(layers)
    head = make([model.get_output_embeddings()], True) if options.fast_linear or quantised else None
    if isinstance(head, FastLinear):
        groups["head"].append(head)
    engine = Engine(options, run, lean, head, norm)
    engine.snapshot(list(model.parameters()))
    engine.plan_all(dict(groups))
    engine.build_seconds = time.perf_counter() - start
    return engine


def lean_range(layers: list[nn.Module], windows: tuple, keys: tuple) -> Callable:
    """The function ``torch.compile`` traces for a range of lean layers: masks by window key."""
    slots = tuple(keys.index(window) for window in windows)

    def run(
        hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, masks: tuple, cache: object
    ) -> torch.Tensor:
        for layer, slot in zip(layers, slots, strict=True):
            hidden = layer(hidden, (cos, sin), masks[slot], cache)
        return hidden

    return run
