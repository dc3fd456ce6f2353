"""Linear layers over 4-bit and 8-bit weights for decoding: PyTorch's in-tree packed kernels, called directly.

``Int4Linear`` runs ``aten._weight_int4pack_mm`` (CPU and CUDA) over codes in groups of 32, each group's weight
``(q - 8) * scale + zero``; a GGUF's Q4_0/Q4_1 blocks map onto it exactly, its Q8_0 blocks as two 4-bit halves.
``Int8Linear`` runs ``aten._weight_int8pack_mm`` (per output channel). Products take bf16 activations and
scales (the kernels' fast path) and return fp32. Packs depend on the CPU: made at load, never saved.
Numerics and measurements: docs/design/int4.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.runtime.gguf_blocks import GROUP, Blocks

PRODUCT_DTYPE = torch.bfloat16  # activations and scales of the fast kernels
ROW_MULTIPLE = 16  # the int4 packing needs N divisible by 16: rows are padded with zero weights


def kernel_form(blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [N, K'] 0..15, scale [N, K'/32], zero [N, K'/32])`` with ``w = (q - 8) * scale + zero``.

    Q4 blocks: ``zero = offset + 8 * scale`` (fp32). The kernels round scale and zero to the products' dtype.
    Q8_0 blocks: ``q = 16 * hi + lo`` with ``lo`` in 0..15 and ``hi`` in -8..7, laid side by side (``K' = 2K``,
    the input repeated): ``lo`` with ``(scale, 8 * scale)``, ``hi + 8`` with ``(16 * scale, 0)``.
    """
    if blocks.kind != "q8_0":
        return blocks.codes.to(torch.uint8), blocks.scale, blocks.offset + 8 * blocks.scale
    q = blocks.codes.view(torch.uint8)  # two's complement: hi + 8 = (q >> 4) ^ 8, all in uint8
    low, high = q & 0x0F, (q >> 4) ^ 8
    codes = torch.cat([low, high], 1)
    scale = torch.cat([blocks.scale, 16 * blocks.scale], 1)
    zero = torch.cat([8 * blocks.scale, torch.zeros_like(blocks.scale)], 1)
    return codes, scale, zero


def quantize_blocks(weight: torch.Tensor, bits: int) -> Blocks:
    """Blocks for a float weight ``[N, K]`` (K divisible by 32), quantised at load: a different model.

    ``bits=4``: asymmetric min/max per group (Q4_1's rule); ``bits=8``: symmetric per group (Q8_0's rule).
    Scales are kept in fp16, as a GGUF file keeps them.
    """
    n, k = weight.shape
    groups = weight.detach().float().view(n, k // GROUP, GROUP)
    if bits == 8:
        scale = (groups.abs().amax(-1) / 127).half().float()
        codes = torch.where(scale[..., None] > 0, groups / scale[..., None], 0).round().clamp(-128, 127)
        return Blocks("q8_0", codes.to(torch.int8).view(n, k), scale, torch.zeros_like(scale))
    low, high = groups.amin(-1), groups.amax(-1)
    scale, offset = ((high - low) / 15).half().float(), low.half().float()
    codes = torch.where(scale[..., None] > 0, (groups - offset[..., None]) / scale[..., None], 0)
    return Blocks("q4_1", codes.round().clamp(0, 15).to(torch.uint8).view(n, k), scale, offset)


PACK_ROWS = 4096  # rows packed at a time on a CPU (a multiple of the kernel's row blocks: the same layout)


def pack_int4(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The kernel's packed layout of ``codes [N, K]`` (0..15) for ``device`` (it depends on the CPU's ISA).
    On a CPU the packing reads int32 codes: converted ``PACK_ROWS`` rows at a time, not the whole head."""
    if device.type == "cuda":  # tinygemm: two codes a byte, K tiled by 16 * inner_tiles (8, 4 or 2)
        pairs = codes.to(device)
        tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(
            (pairs[:, ::2] << 4 | pairs[:, 1::2]).contiguous(), tiles
        )
    chunks = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes[i : i + PACK_ROWS].to(torch.int32), 1)
        for i in range(0, codes.shape[0], PACK_ROWS)
    ]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


class QuantProduct(nn.Module):
    """What ``Int4Linear`` and ``Int8Linear`` share: the bias, and the way rows come out (input dtype, bias,
    shape). Like every engine part they are copies: ``Engine.stale`` says when the parameters changed."""

    def __init__(self, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.bias = None if bias is None else bias.detach().float()

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


class Int4Linear(QuantProduct):
    """``y = x @ w.T + bias`` over 4-bit codes in groups of 32 (``kernel_form``), bf16 products, fp32 out.

    Args:
        parts: the ``Blocks`` of one or more weights with the same input (fused side by side, e.g. q, k, v).
        bias: ``[N]`` or None.
    """

    def __init__(
        self,
        parts: Sequence[Blocks],
        bias: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        products: torch.dtype = PRODUCT_DTYPE,
    ) -> None:
        super().__init__(bias)
        forms = [kernel_form(b) for b in parts]
        codes, scale, zero = (torch.cat(t) for t in zip(*forms, strict=True))
        self.out_features = codes.shape[0]
        self.in_features = parts[0].shape[1]
        self.repeat = codes.shape[1] // self.in_features  # 2 for Q8_0 halves
        if any(b.kind == "q8_0" for b in parts) and not all(b.kind == "q8_0" for b in parts):
            raise ValueError("Int4Linear fuses Q4 blocks with Q4 blocks and Q8_0 with Q8_0 only")
        pad = -self.out_features % ROW_MULTIPLE
        if pad:
            codes = F.pad(codes, (0, 0, 0, pad), value=8)  # (8 - 8) * 0 + 0: zero rows
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        self.device = torch.device(device)
        self.packed = pack_int4(codes, self.device)
        # [K'/32, N, 2]: (scale, zero) per group and output, in the products' dtype (fp32: the weights exactly,
        # on the kernel's slow path; bf16: the fast path)
        self.products = products
        self.scale_zero = torch.stack([scale.t(), zero.t()], -1).to(self.device, products).contiguous()
        self.kinds = tuple(sorted({b.kind for b in parts}))
        self.padded = pad > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.products)
        if self.repeat > 1:
            flat = flat.repeat(1, self.repeat)
        if self.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(flat, self.packed, GROUP, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scale_zero)
        return self._finish(y[:, : self.out_features] if self.padded else y, x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, blocks={'/'.join(self.kinds)}"


class Stacked(nn.Module):
    """Products of one input side by side, each its own module (e.g. Q4 and Q8_0 blocks, which one 4-bit
    product cannot mix): outputs concatenated along the last dimension."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], -1)


class Int8Linear(QuantProduct):
    """``y = x @ w.T + bias`` over int8 weights with one scale per output channel (quantised at load:
    ``scale = max|w_n| / 127``), bf16 products, fp32 out. A different model from the float weights."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(bias)
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        self.weight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scales = scale.to(PRODUCT_DTYPE)
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(PRODUCT_DTYPE)
        return self._finish(torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales), x)
