"""Linear layers for decoding on a CPU: pre-packed weights, the fastest kernel chosen per number of rows.

``FastLinear`` keeps the plain weight, the packed copies its plan uses (MKL, oneDNN) and a plan: the kernel
for each small number of rows M; larger M use ``F.linear``. ``calibrate`` picks the plan by timing the kernels
on the model's own weights. Packed weights are for inference only: ``stale()`` says when the parameters
changed. Why small-M products need this, and the kernels: docs/design/runtime.md.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable, MutableMapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("linear", "mkl", "dnn")
PROBE_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)  # M values timed by ``calibrate``
TIE = 0.05  # a plain ``F.linear`` must be this much faster to be chosen over a packed kernel
MAX_PLANNED_ROWS = PROBE_ROWS[-1]  # above: F.linear (large M is what MKL's GEMM is built for)


def available_kernels(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """Kernels usable for weights on ``device`` in ``dtype``: packing is a CPU fp32 matter (oneDNN's bf16
    path needs AVX-512 or AVX-NE-CONVERT; it is probed, not assumed)."""
    if device.type != "cpu":
        return ("linear",)
    kernels = ["linear"]
    if dtype == torch.float32 and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        kernels.append("mkl")
    if torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16):
        try:
            probe = torch.zeros(8, 8, dtype=dtype)
            torch.ops.mkldnn._linear_pointwise(
                probe, torch.ops.mkldnn._reorder_linear_weight(probe, None), None, "none", [], ""
            )
            kernels.append("dnn")
        except RuntimeError:  # e.g. bf16 on a CPU without the instructions oneDNN needs
            pass
    return tuple(kernels)


class FastLinear(nn.Module):
    """``y = x @ weight.T + bias`` with a kernel chosen per number of rows of ``x``; for inference only.

    Args:
        weight: ``[N, K]`` (detached; may be a concatenation of several layers' weights, e.g. fused QKV).
        bias: ``[N]`` or None.
        sources: the parameters ``weight``/``bias`` were made from (their versions are recorded).
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, sources: Sequence[torch.Tensor] = ()
    ) -> None:
        super().__init__()
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.out_features, self.in_features = self.weight.shape
        self._sources = [p for p in sources if not p.is_inference()]  # (those keep no version counter)
        self._versions = [p._version for p in self._sources]
        self.packed: dict[str, torch.Tensor] = {}
        self.plan: tuple[str, ...] = ()
        self._calls: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = ()

    @classmethod
    def fuse(cls, linears: Sequence[nn.Linear]) -> FastLinear:
        """One layer computing the outputs of ``linears`` (same input) side by side: ``[N1 + N2 + ..., K]``."""
        weights = [lin.weight for lin in linears]
        biases = [lin.bias for lin in linears]
        if any(b is not None for b in biases):
            biases = [
                b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
                for b, w in zip(biases, weights, strict=True)
            ]
            bias = torch.cat([b.detach() for b in biases])
        else:
            bias = None
        sources = [p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
        weight = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
        return cls(weight, bias, sources)

    def stale(self) -> bool:
        """True when a source parameter was modified in place since this layer was built."""
        return any(p._version != v for p, v in zip(self._sources, self._versions, strict=True))

    # ----------------------------------------------------------------------------------------------------
    def _kernel(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        weight, bias = self.weight, self.bias
        if name == "linear":
            return lambda x: F.linear(x, weight, bias)
        if name == "mkl":
            if "mkl" not in self.packed:
                self.packed["mkl"] = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)
            packed = self.packed["mkl"]
            return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, bias, 1)
        if name == "dnn":
            if "dnn" not in self.packed:
                self.packed["dnn"] = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            packed = self.packed["dnn"]
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        raise ValueError(f"unknown linear kernel '{name}'; choices: {', '.join(KERNELS)}")

    def set_plan(self, plan: Sequence[str]) -> None:
        """Use kernel ``plan[M - 1]`` for inputs of M rows (``mkl`` only at M = 1); drop unused packs."""
        plan = tuple(plan)
        for rows, name in enumerate(plan, start=1):
            if name not in KERNELS or (name == "mkl" and rows != 1):
                raise ValueError(f"kernel '{name}' cannot serve {rows} rows (mkl packs are for M = 1)")
        for name in list(self.packed):
            if name not in plan:
                del self.packed[name]
        self.plan = plan
        kernels = {name: self._kernel(name) for name in set(plan)}
        self._calls = tuple(kernels[name] for name in plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and x.requires_grad) or torch.compiler.is_compiling():
            # training never uses packs; a compiled graph picks its own kernels (packed oneDNN weights are
            # opaque tensors that inductor cannot trace)
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        if rows <= len(self._calls):
            return self._calls[rows - 1](x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, plan={'/'.join(self.plan) or 'linear'}"


def inference_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s module tree sharing its parameters and buffers (nothing is duplicated), whose
    submodules can be swapped without touching the original."""
    memo = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo)


def packed_copy(
    module: nn.Module,
    groups: MutableMapping[str, list[FastLinear]],
    make: Callable[[Sequence[nn.Linear]], nn.Module] | None = None,
) -> nn.Module:
    """An inference copy of ``module`` with every ``nn.Linear`` swapped for a ``FastLinear`` over the same
    weights (or what ``make([linear])`` returns), each ``FastLinear`` appended to ``groups["<out>x<in>"]``
    (one list per shape: what ``calibrate`` plans)."""
    twin = inference_copy(module)
    for name, mod in list(twin.named_modules()):
        if isinstance(mod, nn.Linear):
            fast = FastLinear.fuse([mod]) if make is None else make([mod])
            twin.set_submodule(name, fast)
            if isinstance(fast, FastLinear):
                groups.setdefault(f"{mod.out_features}x{mod.in_features}", []).append(fast)
    return twin


# --------------------------------------------------------------------------------------------------------
# Choosing the plan by measurement
def uniform_plan(kernel: str, rows: int = MAX_PLANNED_ROWS, available: Sequence[str] = KERNELS) -> list[str]:
    """A fixed plan: ``kernel`` for every M (``mkl`` at M = 1 only, ``dnn`` above it), where available."""
    fallback = "dnn" if "dnn" in available else "linear"
    plan = []
    for m in range(1, rows + 1):
        name = kernel if kernel in available else "linear"
        if name == "mkl" and m > 1:
            name = fallback
        plan.append(name)
    return plan


def _time(call: Callable[[], object], repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(
    group: Sequence[FastLinear],
    available: Sequence[str],
    *,
    rows: Sequence[int] = PROBE_ROWS,
    repeats: int = 5,
    max_members: int = 8,
    budget_s: float = 1.5,
) -> tuple[list[str], dict[int, dict[str, float]]]:
    """Time every kernel in ``available`` at each M of ``rows`` on ``group`` (layers of one shape), set the
    plan that measured fastest for the group (``_threshold_plan``), and return it with the timings (seconds
    per sweep).

    A sweep runs up to ``max_members`` members of the group one after the other (distinct weights, so they
    stream from memory as in decoding); kernels are interleaved and the best of ``repeats`` rounds is kept
    (the least disturbed on a shared machine). A kernel whose output differs from ``F.linear`` by more than
    rounding is dropped. Probing stops once the sweeps have taken ``budget_s`` (larger M then keep the last
    decision).
    """
    members = list(group)[:max_members]
    first = members[0]
    dtype, device = first.weight.dtype, first.weight.device
    kernels = [k for k in KERNELS if k in available]
    probe = torch.randn(max(rows), first.in_features, dtype=dtype, device=device)
    timings: dict[int, dict[str, float]] = {}
    spent = 0.0
    with torch.inference_mode():
        for m in rows:
            x = probe[:m]
            ref = F.linear(x, first.weight, first.bias)
            scale = ref.abs().max().item() + 1.0
            candidates = {}
            for name in kernels:
                if name == "mkl" and m != 1:
                    continue
                calls = [member._kernel(name) for member in members]
                if (calls[0](x) - ref).abs().max().item() > 1e-4 * scale:
                    continue  # not within fp32 rounding: never used
                candidates[name] = calls
            results = {name: math.inf for name in candidates}
            start = time.perf_counter()
            for calls in candidates.values():
                for call in calls:
                    call(x)  # warm-up (first use of a pack)
            for _ in range(repeats):
                for name, calls in candidates.items():
                    t = _time(lambda calls=calls, x=x: [call(x) for call in calls], 1)
                    results[name] = min(results[name], t)
            timings[m] = results
            spent += time.perf_counter() - start
            if spent > budget_s:
                break
    plan = _threshold_plan(timings, max(rows))
    for member in group:
        member.set_plan(plan)
    return plan, timings


def _threshold_plan(timings: dict[int, dict[str, float]], rows: int) -> list[str]:
    """The plan from the timings: at M = 1 the fastest kernel (a packed one unless ``F.linear`` is ``TIE``
    faster); above, oneDNN for M below a threshold and ``F.linear`` from it on, the threshold minimising the
    summed time relative to the best kernel at each probed M. One switch point instead of a choice per M: a
    single disturbed measurement on a shared machine cannot flip an isolated M."""
    first = timings.get(1, {"linear": 1.0})
    packed = {k: v for k, v in first.items() if k != "linear"}
    at_one = min(packed, key=packed.get) if packed else "linear"
    if "linear" in first and first["linear"] < (1 - TIE) * first.get(at_one, math.inf):
        at_one = "linear"
    probes = sorted(m for m in timings if m > 1 and "dnn" in timings[m] and "linear" in timings[m])
    threshold = rows + 1  # oneDNN up to the last planned M
    if probes:

        def cost(limit: int) -> float:
            total = 0.0
            for m in probes:
                best = min(timings[m].values())
                total += timings[m]["dnn" if m < limit else "linear"] / best
            return total

        candidates = [*probes, rows + 1]  # ties: the largest threshold (the packed kernel)
        scores = {limit: cost(limit) for limit in candidates}
        threshold = min(candidates, key=lambda limit: (round(scores[limit], 6), -limit))
        if threshold > probes[-1]:
            threshold = rows + 1
    elif not any("dnn" in t for t in timings.values()):
        threshold = 2  # no oneDNN kernel: F.linear above one row
    return [at_one] + ["dnn" if m < threshold else "linear" for m in range(2, rows + 1)]
