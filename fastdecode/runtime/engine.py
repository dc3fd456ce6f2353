"""The decoding execution engine: lean inference layers, packed linear kernels, static-shape compiled steps.

``Engine`` is built once per model from the same parameters (``EarlyExitModel.use_engine``): ``RotaryLayer``
for the pre-norm rotary families, ``FastLinear`` projections and head with calibrated kernel plans, the
static cache and compiled layer ranges (``EngineOptions``). It is used only while gradients are disabled and
rebuilt when a packed parameter changes (``stale``). What each part does: docs/design/runtime.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.runtime.fast_linear import FastLinear, available_kernels, calibrate, packed_copy, uniform_plan
from fastdecode.runtime.weights import FP32, Weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    """How decoding runs. ``kernel``: None = pick per M by measurement; ``linear``/``mkl``/``dnn`` = that
    kernel for every M it can serve (``mkl`` at M = 1, then ``dnn``). ``compile`` needs ``static_cache``."""

    fast_layers: bool = True
    fast_linear: bool = True
    kernel: str | None = None
    static_cache: bool = False
    compile: bool = False
    compile_mode: str | None = None  # torch.compile mode; None: "reduce-overhead" on CUDA, default elsewhere
    weights: Weights = FP32  # what the products read (fastdecode/runtime/weights.py)

    @property
    def build_key(self) -> tuple:
        """What the built layers depend on (the cache mode and compilation do not change them)."""
        return (
            self.fast_layers,
            self.fast_linear,
            self.kernel if self.fast_linear else None,
            self.weights.key,
        )


def default_options(
    device: torch.device,
    *,
    fast_layers: bool | None = None,
    fast_linear: bool | None = None,
    kernel: str | None = None,
    static_cache: bool | None = None,
    compile: bool = False,
    weights: Weights = FP32,
) -> EngineOptions | None:
    """Options with the defaults filled in (None = the default for ``device``), or None for plain HF layers.

    Defaults, by measurement (docs/BENCHMARKS.md, "Execution engine"): on a CPU fast layers and packed
    kernels (faster at every measured M); on CUDA neither (not measured here: ``eval/gpu_check.sh``
    measures them). ``compile`` implies the static cache. 4-bit or 8-bit ``weights`` always build an engine.
    """
    cpu = device.type == "cpu"
    fast_layers = cpu if fast_layers is None else fast_layers
    fast_linear = cpu if fast_linear is None else fast_linear
    static_cache = compile if static_cache is None else static_cache
    if compile and not static_cache:
        from fastdecode.config import ConfigError

        raise ConfigError("decoder.compile=true needs the static cache (decoder.static_cache=true or null).")
    if not (fast_layers or fast_linear or static_cache or compile) and weights.kind == "fp32":
        return None
    return EngineOptions(fast_layers, fast_linear, kernel, static_cache, compile, weights=weights)


INVARIANT_STEPS = 32  # verification widths computed one query at a time on the 4-bit path (above: prefills)


# --------------------------------------------------------------------------------------------------------
# Lean layers
def rotary_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``(cos, sin) [B, T, D]`` -> ``(cos, sin') [B, 1, T, D]`` with the sign of ``rotate_half`` folded
    into ``sin'``: ``x * cos + roll(x, D/2) * sin'`` equals ``x * cos + rotate_half(x) * sin`` exactly."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), -1)
    return cos[:, None], signed[:, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: ``weight * (x * rsqrt(mean(x^2) + eps))`` computed in fp32, as one op in fp32."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RotaryLayer(nn.Module):
    """One pre-norm rotary decoder layer with a SiLU-gated MLP, on fused projections.

    ``forward(hidden [B, T, H], rotary, mask, cache)``: ``rotary`` from ``rotary_factors``; ``mask``: an additive
    ``[B, 1, T, S]`` mask, or None for full attention (T = 1) / causal attention from slot 0 (T > 1);
    ``cache``: a ``KVCache`` (``update(k, v, index)`` returns the keys/values to attend to) or None.
    """

    def __init__(
        self,
        index: int,
        norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]],
        qkv: nn.Module,
        o: nn.Module,
        gate_up: nn.Module,
        down: nn.Module,
        heads: int,
        kv_heads: int,
        head_dim: int,
        scaling: float,
    ) -> None:
        super().__init__()
        self.index = index
        (self.norm1, self.eps1), (self.norm2, self.eps2) = ((w.detach(), e) for w, e in norms)
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.heads, self.kv_heads, self.head_dim, self.scaling = heads, kv_heads, head_dim, scaling
        self.gqa = kv_heads != heads
        self.invariant = False  # attention of a few queries one at a time (4-bit/8-bit weights: see below)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache=None,
    ) -> torch.Tensor:
        batch, steps, _ = hidden.shape
        heads, rotated = self.heads, self.heads + self.kv_heads
        x = rms_norm(hidden, self.norm1, self.eps1)
        # [B, heads + 2 kv_heads, T, D]: one transpose for q, k and v
        qkv = self.qkv(x).view(batch, steps, rotated + self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary
        qk = qkv[:, :rotated]
        qk = qk * cos + qk.roll(self.head_dim // 2, -1) * sin
        q, k = qk.split((heads, self.kv_heads), 1)
        v = qkv[:, rotated:]
        if cache is not None:
            k, v = cache.update(k, v, self.index)
        rows = None
        if self.invariant and cache is not None and 1 < steps <= INVARIANT_STEPS:
            # (not inside a compiled graph: its host-side choices would break it; compiled ranges keep SDPA)
            rows = None if torch.compiler.is_compiling() else cache.query_rows(mask, steps, k.shape[2])
        if rows is not None:
            attn = self._one_query_at_a_time(q, k, v, rows)
        else:
            attn = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=mask is None and steps > 1,
                scale=self.scaling,
                enable_gqa=self.gqa,
            )
        hidden = hidden + self.o(attn.transpose(1, 2).reshape(batch, steps, heads * self.head_dim))
        gate, up = self.gate_up(rms_norm(hidden, self.norm2, self.eps2)).chunk(2, -1)
        return hidden + self.down(F.silu(gate) * up)

    def _one_query_at_a_time(self, q, k, v, rows: list) -> torch.Tensor:
        """Attention of ``q [B, H, T, D]`` computed per query, each exactly as a one-token step at its slot
        computes it (``KVCache.query_rows``: same keys, same mask or none): SDPA's rounding depends on the
        number of queries and keys, and bf16 products turn that into flipped tokens; this keeps verification
        bitwise equal to decoding."""
        outs = []
        for i, (keys, row) in enumerate(rows):
            if isinstance(keys, int):
                ki, vi = k[:, :, :keys], v[:, :, :keys]
            else:
                ki, vi = k.index_select(2, keys), v.index_select(2, keys)
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, i : i + 1], ki, vi, attn_mask=row, scale=self.scaling, enable_gqa=self.gqa
                )
            )
        return torch.cat(outs, 2)

    def linears(self) -> dict[str, nn.Module]:
        return {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down}


# --------------------------------------------------------------------------------------------------------
# The engine
COMPILE_GRAPH_LIMIT = 128
_PLANS: dict[tuple, list[str]] = {}  # calibrated plans per (shape, dtype, threads, kernels): measured once


@dataclass
class Engine:
    """Built by ``EarlyExitModel.use_engine``: the layers decoding runs and the head it scores with.

    ``lean``: the layers are ``RotaryLayer``s (else HF layer copies with ``FastLinear`` projections or, with
    ``fast_linear`` off, the HF layers themselves). ``final_norm``: (weight, eps) of an RMSNorm final norm for
    lean layers, else None (the HF module runs). ``plans``: the kernel plan per linear group. ``head``: a
    ``FastLinear``, or with 4-bit/8-bit ``options.weights`` an ``Int4Linear``/``Int8Linear``.
    """

    options: EngineOptions
    layers: list[nn.Module]
    lean: bool
    head: nn.Module | None
    final_norm: tuple[torch.Tensor, float] | None = None
    plans: dict[str, list[str]] = field(default_factory=dict)
    timings: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    build_seconds: float = 0.0
    compile_seconds: dict[tuple, float] = field(default_factory=dict)
    _compiled: dict[tuple, Callable] = field(default_factory=dict)
    _sources: list[torch.Tensor] = field(default_factory=list)
    _versions: list[int] = field(default_factory=list)
    _subset: tuple | None = None  # (ids, head version, FastLinear) for exit_logits_subset
    _packed: dict[int, tuple[nn.Module, nn.Module]] = field(default_factory=dict)  # id -> (module, copy)

    def linears(self) -> list[FastLinear]:
        found = [mod for layer in self.layers for mod in layer.modules() if isinstance(mod, FastLinear)]
        return found + ([self.head] if isinstance(self.head, FastLinear) else [])

    def snapshot(self, parameters: Sequence[torch.Tensor]) -> None:
        """Record the versions of every parameter the engine was built from (``stale`` compares them)."""
        self._sources = list(parameters)
        self._versions = [p._version for p in self._sources]

    def stale(self) -> bool:
        """True when a parameter was modified in place since the build (e.g. by an optimizer step): packed
        and fused copies no longer match it. One version read per parameter, no tensor data."""
        return [p._version for p in self._sources] != self._versions

    def subset_head(self, ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> FastLinear:
        """A ``FastLinear`` over rows ``ids`` of the head (cached per ``ids`` object and head version)."""
        cached = self._subset
        if cached is None or cached[0] is not ids or cached[1] != weight._version:
            rows = FastLinear(
                weight.detach().index_select(0, ids),
                None if bias is None else bias.detach().index_select(0, ids),
                [weight],
            )
            rows._versions = [weight._version]
            self._plan_group("head_subset", [rows])
            cached = self._subset = (ids, weight._version, rows)
        return cached[2]

    # ----------------------------------------------------------------------------------------------------
    def _plan_group(self, name: str, group: Sequence[FastLinear]) -> None:
        """Give ``group`` (one shape) its kernel plan: the forced kernel, or calibrated (once per shape)."""
        if not group:
            return
        first = group[0]
        available = available_kernels(first.weight.device, first.weight.dtype)
        kernel = self.options.kernel
        if not self.options.fast_linear:
            plan = uniform_plan("linear")
        elif kernel is not None:
            plan = uniform_plan(kernel, available=available)
        else:
            key = (
                first.out_features,
                first.in_features,
                first.bias is not None,
                first.weight.dtype,
                str(first.weight.device),
                torch.get_num_threads(),
                available,
            )
            plan = _PLANS.get(key)
            if plan is None:
                plan, timings = calibrate(group, available)
                _PLANS[key] = plan
                self.timings[name] = timings
        for lin in group:
            lin.set_plan(plan)
        self.plans[name] = list(plan)

    def plan_all(self, groups: dict[str, list[FastLinear]]) -> None:
        start = time.perf_counter()
        for name, group in groups.items():
            self._plan_group(name, group)
        self.build_seconds += time.perf_counter() - start

    def packed(self, module: nn.Module) -> nn.Module:
        """``module`` (a drafter run beside the model, e.g. an EAGLE-3 head) as this engine runs linears: an
        inference copy whose ``nn.Linear``s are ``FastLinear``s planned like the model's (``fast_linear``;
        kept per module, built on first use), else ``module`` itself. For inference only: its parameters
        must not change while the copy is used (the packs are copies)."""
        if not self.options.fast_linear:
            return module
        found = self._packed.get(id(module))
        if found is None or found[0] is not module:
            groups: dict[str, list[FastLinear]] = {}
            twin = packed_copy(module, groups)
            self.plan_all(groups)
            found = self._packed[id(module)] = (module, twin)
        return found[1]

    # ----------------------------------------------------------------------------------------------------
    def compiled_range(self, start: int, end: int, steps: int, run: Callable) -> Callable:
        """``torch.compile`` of ``run`` (layers ``[start, end)``) for ``steps`` new tokens: one graph per
        (range, T), static shapes; compile time (first call) is recorded in ``compile_seconds``."""
        key = (start, end, steps)
        fn = self._compiled.get(key)
        if fn is None:
            mode = self.options.compile_mode
            if mode is None:
                cuda = self.head is not None and any(t.is_cuda for t in self._sources[:1])
                mode = "reduce-overhead" if cuda else None
            # Every range shares one code object (``run``); dynamo's per-code-object graph limit must cover
            # one graph per (range, T, batch, capacity) bucket.
            dynamo_config = torch._dynamo.config
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, COMPILE_GRAPH_LIMIT)
            compiled = torch.compile(run, dynamic=False, fullgraph=True, mode=mode)

            def first_call(*args, _compiled=compiled, _key=key):
                began = time.perf_counter()
                out = _compiled(*args)
                if out.is_cuda:
                    torch.cuda.synchronize()
                self.compile_seconds[_key] = time.perf_counter() - began
                self._compiled[_key] = _compiled
                return out

            fn = self._compiled[key] = first_call
        return fn
