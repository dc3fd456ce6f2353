"""The quantised blocks a GGUF file ships, read as they are and named by Hugging Face parameter names.

``read_blocks(path, heads, kv_heads)`` maps each HF weight (``model.layers.3.mlp.up_proj.weight``) to its blocks:
the 4-bit or 8-bit codes and the fp16 scales of llama.cpp's Q4_0, Q4_1 and Q8_0 formats (groups of 32 along
the input dimension), with the rows of Llama's q/k projections put back in HF's order (llama.cpp's converter
interleaves them). ``register``/``shipped`` keep which file a loaded model came from. Formats: docs/design/int4.md.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

GROUP = 32  # values per block in Q4_0, Q4_1 and Q8_0
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
KIND = {Q4_0: "q4_0", Q4_1: "q4_1", Q8_0: "q8_0"}
PERMUTED_ARCHS = ("llama",)  # llama.cpp's converter interleaves q/k rows for these

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Blocks:
    """One weight ``w [N, K]`` as shipped: ``w[n, 32g + j] = scale[n, g] * codes[n, 32g + j] + offset[n, g]``.

    ``codes``: ``[N, K]`` uint8 (0..15, Q4) or int8 (Q8_0); ``scale``/``offset``: ``[N, K / 32]`` fp32 holding
    the fp16 values of the file exactly (Q4_0: ``offset = -8 * scale``; Q8_0: ``offset = 0``).
    """

    kind: str
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` the blocks encode (what a dequantising loader computes)."""
        n, k = self.codes.shape
        codes = self.codes.float().view(n, k // GROUP, GROUP)
        return (codes * self.scale[..., None] + self.offset[..., None]).view(n, k)


def decode_rows(kind: int, raw: np.ndarray) -> Blocks:
    """``raw``: ``[N, K / 32 * bytes_per_block]`` uint8 rows of one GGUF tensor -> its ``Blocks``."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, BLOCK_BYTES[kind])
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == Q8_0:
        codes = blocks[..., 2:].copy().view(np.int8).reshape(n, -1)
        offset = np.zeros_like(scale)
    else:
        packed = blocks[..., 4:] if kind == Q4_1 else blocks[..., 2:]
        low, high = packed & 0x0F, packed >> 4  # low nibbles: values 0-15 of a block; high: 16-31
        codes = np.concatenate([low, high], axis=-1).reshape(n, -1)
        if kind == Q4_1:
            offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:
            offset = -8.0 * scale
    return Blocks(KIND[kind], torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(offset))


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving (its converter's ``permute``): GGUF row order -> HF's."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor of a Llama-style model (None: not a weight we read)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
    return None


@dataclass(frozen=True)
class ShippedTensor:
    """One quantised tensor of the memory-mapped file, decoded on demand (``blocks``): nothing is read
    until then. ``heads``: undo llama.cpp's q/k row interleaving over this many heads (None: rows as stored)."""

    kind: int
    rows: np.ndarray  # [N, K / 32 * bytes_per_block] uint8, a view of the mapped file
    heads: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[0], self.rows.shape[1] // BLOCK_BYTES[self.kind] * GROUP

    def blocks(self) -> Blocks:
        rows = self.rows if self.heads is None else unpermute_rows(self.rows, self.heads)
        return decode_rows(self.kind, rows)


def read_blocks(path: str | Path, heads: int, kv_heads: int) -> tuple[str, dict[str, ShippedTensor]]:
    """The architecture named in ``path`` and its Q4_0/Q4_1/Q8_0 weights by HF name (other types are left to
    the dequantised checkpoint). The file is memory-mapped; a tensor is read when its ``blocks`` are."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    found: dict[str, ShippedTensor] = {}
    for tensor in reader.tensors:
        kind, name = int(tensor.tensor_type), hf_name(tensor.name)
        if kind not in BLOCK_BYTES or name is None:
            continue
        part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
        permuted = arch in PERMUTED_ARCHS and part in ("attn_q", "attn_k")
        found[name] = ShippedTensor(
            kind, tensor.data, (heads if part == "attn_q" else kv_heads) if permuted else None
        )
    return arch, found


# --------------------------------------------------------------------------------------------------------
# Which file a loaded model came from
_SHIPPED: weakref.WeakKeyDictionary[nn.Module, Shipped] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Shipped:
    """The GGUF a model was loaded from, what names its content (``digest``), the model's parameters by name,
    and their state then (``state``)."""

    path: Path
    digest: str
    params: dict[str, nn.Parameter]
    loaded: tuple[tuple[int, int], ...]

    def state(self) -> tuple[tuple[int, int], ...]:
        """Each parameter's (storage, version) now: what changes when it is trained, assigned or loaded into."""
        return tuple((p.data_ptr(), p._version) for p in self.params.values())


def register(model: nn.Module, path: str | Path, digest: str | None = None) -> None:
    """Record that ``model``'s weights, as they are now, were dequantised from the GGUF at ``path``
    (``loading.load_model``, after converting it once and checking the conversion). ``digest`` names the file's
    content (a verified package's hash); default: its name, size and modification time."""
    path = Path(path)
    if digest is None:
        stat = path.stat()
        digest = f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}"
    params = dict(model.named_parameters())
    state = tuple((p.data_ptr(), p._version) for p in params.values())
    _SHIPPED[model] = Shipped(path, digest, params, state)


def shipped(model: nn.Module) -> Shipped | None:
    """Where ``model`` was loaded from (``register``), or None."""
    return _SHIPPED.get(model)
