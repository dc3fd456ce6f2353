"""Which weights the engine's products read: fp32, a GGUF's 4-bit blocks as shipped, or quantised at load.

``resolve_weights(requested, model, device)`` turns ``decoder.weights`` (``auto``, ``fp32``, ``int4``, ``int8``)
into a ``Weights``: the kind, the label every output that names the model carries, and the shipped blocks by
parameter (used only where they encode the parameter's current values exactly). ``linear_maker`` builds the
engine's product for a group of ``nn.Linear``s of one input. Numerics and measurements: docs/design/int4.md.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.files.checkpoint import verify_requested
from fastdecode.runtime import gguf_blocks
from fastdecode.runtime.fast_linear import FastLinear
from fastdecode.runtime.gguf_blocks import GROUP, KIND, ShippedTensor
from fastdecode.runtime.quant_linear import Int4Linear, Int8Linear, Stacked, quantize_blocks

log = logging.getLogger(__name__)

WEIGHTS = ("auto", "fp32", "int4", "int8")
SHIPPED_LABEL = "{kinds} blocks as shipped, bf16 products"
QUANTISED_LABEL = "{kind} quantised at load (a different model), bf16 products"


@dataclass(frozen=True)
class Weights:
    """What the engine's products read. ``kind``: ``fp32`` (the parameters, in their dtype), ``int4`` or
    ``int8``; ``label``: how outputs name it; ``blocks``: the shipped tensors by ``id(parameter)``."""

    kind: str
    label: str
    blocks: dict[int, ShippedTensor] = field(default_factory=dict, compare=False, hash=False)

    @property
    def key(self) -> str:
        """What a built engine and a measured cost depend on: the kind, shipped or quantised at load."""
        return self.kind if self.kind == "fp32" or not self.blocks else f"{self.kind}-shipped"


FP32 = Weights("fp32", "fp32")
# per model: (parameters' state, {id(parameter): ShippedTensor}) of the shipped tensors that encode them
_CHECKED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, dict[int, ShippedTensor]]] = (
    weakref.WeakKeyDictionary()
)


def exact_blocks(model: nn.Module, verify: bool = False) -> dict[int, ShippedTensor]:
    """The shipped tensors (``gguf_blocks.shipped``) that encode ``model``'s parameters bit for bit, by
    ``id(parameter)``: those of parameters unchanged since the load that dequantised them (same storage and
    version; a trained or reloaded parameter no longer counts). ``verify`` (or ``$FASTDECODE_VERIFY=1``) also
    compares every value, which reads all the float weights; a mismatch is then refused."""
    found = gguf_blocks.shipped(model)
    if found is None:
        return {}
    state = found.state()
    cached = _CHECKED.get(model)
    if cached is not None and cached[0] == state and not verify:
        return cached[1]
    cfg = model.config
    heads = cfg.num_attention_heads
    _, tensors = gguf_blocks.read_blocks(
        found.path, heads, getattr(cfg, "num_key_value_heads", None) or heads
    )
    unchanged = {
        name
        for (name, p), then, now in zip(found.params.items(), found.loaded, state, strict=True)
        if then == now
    }
    exact = {}
    for name, tensor in tensors.items():
        param = found.params.get(name)
        if param is None or name not in unchanged or tuple(param.shape) != tensor.shape:
            continue
        if (verify or verify_requested()) and not torch.equal(
            tensor.blocks().dequantize(), param.detach().float().cpu()
        ):
            raise ConfigError(
                f"{name} differs from the blocks of {found.path.name} it was loaded from: delete the converted "
                "model directory to convert it again, or use decoder.weights=fp32."
            )
        exact[id(param)] = tensor
    if len(exact) < len(tensors):
        log.info(
            "%d of %d shipped weights of %s changed since loading: those are not read from the file",
            len(tensors) - len(exact),
            len(tensors),
            found.path.name,
        )
    _CHECKED[model] = (state, exact)
    return exact


def resolve_weights(
    requested: str, model: nn.Module, linears: Sequence[nn.Linear], device: torch.device
) -> Weights:
    """``decoder.weights`` for ``model`` whose engine products are ``linears`` (every layer's and the head).

    ``auto``: the shipped 4-bit blocks where every product has exact ones (on a CPU), else fp32. ``int4``:
    shipped blocks where exact, the rest quantised at load; ``int8``: quantised at load (per channel).
    """
    if requested not in WEIGHTS:
        raise unknown_name_error("weights", requested, list(WEIGHTS), "(decoder.weights)")
    if requested == "fp32":
        return FP32
    if requested in ("int4", "int8"):
        odd = sorted({lin.in_features for lin in linears if lin.in_features % GROUP})
        if odd:
            raise ConfigError(
                f"decoder.weights={requested} needs every product's input width divisible by {GROUP}; this model "
                f"has widths {odd}: use decoder.weights=fp32 (or auto)."
            )
    blocks = exact_blocks(model) if requested != "int8" else {}
    shipped = [blocks[id(lin.weight)] for lin in linears if id(lin.weight) in blocks]
    if requested == "auto":
        if device.type != "cpu" or not linears or len(shipped) < len(linears):
            return FP32
        requested = "int4"
    if requested == "int8":
        return Weights("int8", QUANTISED_LABEL.format(kind="int8 per channel"))
    if len(shipped) == len(linears):
        kinds = "/".join(sorted({KIND[b.kind].upper() for b in shipped}))
        return Weights("int4", SHIPPED_LABEL.format(kinds=kinds), blocks)
    return Weights("int4", QUANTISED_LABEL.format(kind="int4 g32 (head int8 g32)"), blocks)


def linear_maker(weights: Weights, device: torch.device) -> Callable[[Sequence[nn.Linear], bool], nn.Module]:
    """``make(linears, head)``: the engine's product computing ``linears`` (one input) side by side."""

    def make(linears: Sequence[nn.Linear], head: bool = False) -> nn.Module:
        if weights.kind == "fp32":
            return FastLinear.fuse(linears)
        biases = [lin.bias for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b if b is not None else lin.weight.new_zeros(lin.out_features)
                    for b, lin in zip(biases, linears, strict=True)
                ]
            )
        if weights.kind == "int8":
            return Int8Linear(torch.cat([lin.weight.detach() for lin in linears]), bias)
        shipped = [weights.blocks.get(id(lin.weight)) for lin in linears]
        parts = [
            tensor.blocks() if tensor is not None else quantize_blocks(lin.weight, 8 if head else 4)
            for tensor, lin in zip(shipped, linears, strict=True)
        ]
        if len({b.kind == "q8_0" for b in parts}) > 1:  # Q4 and Q8_0 blocks: one product each
            return Stacked([make([lin]) for lin in linears])
        return Int4Linear(parts, bias, device)

    return make
