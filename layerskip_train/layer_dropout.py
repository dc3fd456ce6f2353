"""LayerSkip layer dropout: per-sample stochastic depth whose rate grows with depth (and optionally time).

``dropout_rates`` gives each block's rate, ``drop_mask`` draws each sequence's drops from a generator keyed
by ``(seed, step, micro_step, rank)`` (``fastdecode.training.draws``), and ``run_with_layer_dropout`` runs
the blocks on the kept rows only and returns the residual stream at each exit. Everything is a pure function
of its arguments, so a resumed run draws the same drops. Formula and usage: docs/design/methods.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training.draws import draw_generator

DEPTH_SCALES = ("exp", "linear", "uniform")
TIME_SCALES = ("constant", "exp")


# --------------------------------------------------------------------------------------------------------
# Layer selection
def _index(spec: object, text: str, num_layers: int) -> int:
    try:
        idx = int(text)
    except ValueError:
        raise ConfigError(f"Layer spec {spec!r}: '{text}' is not an integer.") from None
    if not -num_layers <= idx < num_layers:
        raise ConfigError(
            f"Layer spec {spec!r}: index {idx} is out of range; valid indices are 0..{num_layers - 1} "
            f"(or -{num_layers}..-1 from the end) for a {num_layers}-layer model."
        )
    return idx % num_layers


def _slice(spec: str, num_layers: int) -> list[int]:
    parts = spec.split(":")
    if len(parts) > 3:
        raise ConfigError(f"Layer spec {spec!r}: a slice has at most two ':' (start:stop:step).")
    bounds: list[int | None] = []
    for name, text in zip(("start", "stop", "step"), parts, strict=False):
        text = text.strip()
        if not text:
            bounds.append(None)
            continue
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"Layer spec {spec!r}: slice {name} '{text}' is not an integer.") from None
        if name != "step" and not -num_layers <= value <= num_layers:
            raise ConfigError(
                f"Layer spec {spec!r}: slice {name} {value} is out of range; valid range is "
                f"-{num_layers}..{num_layers} for a {num_layers}-layer model."
            )
        if name == "step" and value == 0:
            raise ConfigError(f"Layer spec {spec!r}: slice step must not be 0.")
        bounds.append(value)
    return list(range(num_layers))[slice(*bounds)]


def parse_layers(spec: str | Sequence[int] | None, num_layers: int) -> list[int]:
    """Sorted, unique 0-based layer indices selected by ``spec``.

    ``spec`` is Python slice syntax over the layers (``":"`` all, ``"1::2"`` odd, ``"-4:"`` last four),
    a comma list (``"0,4,5"``, negatives count from the end), a list of ints, or None (all layers).
    Raises ConfigError naming the spec, the bad index and the valid range; a spec selecting no layer is an
    error too (an explicit empty list ``[]`` is allowed and selects none).
    """
    if spec is None:
        return list(range(num_layers))
    if isinstance(spec, str):
        text = spec.strip()
        if ":" in text:
            layers = _slice(text, num_layers)
        else:
            layers = [_index(spec, part.strip(), num_layers) for part in text.split(",") if part.strip()]
        if not layers:
            raise ConfigError(f"Layer spec {spec!r} selects no layer of a {num_layers}-layer model.")
        return sorted(set(layers))
    layers = []
    for item in spec:
        if isinstance(item, bool) or not isinstance(item, int):
            raise ConfigError(f"Layer spec {spec!r}: {item!r} is not an integer layer index.")
        layers.append(_index(spec, str(item), num_layers))
    return sorted(set(layers))


# --------------------------------------------------------------------------------------------------------
# Rates
def depth_scale(name: str, num_layers: int) -> list[float]:
    """``D(l)`` for every layer: ``exp`` 2^(l/(L-1)) - 1, ``linear`` l/(L-1), ``uniform`` 1.

    With a single layer (L = 1) that layer is the last one and gets ``D = 1`` under every scale.
    """
    if name not in DEPTH_SCALES:
        raise unknown_name_error("layer dropout scale", name, list(DEPTH_SCALES))
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if num_layers == 1 or name == "uniform":
        return [1.0] * num_layers
    frac = [layer / (num_layers - 1) for layer in range(num_layers)]
    return [2.0**f - 1.0 for f in frac] if name == "exp" else frac


def time_scale(name: str, step: int, total_steps: int | None = None) -> float:
    """``S(t)``: ``constant`` 1 (continual pre-training, fine-tuning); ``exp`` 2^(t/T) - 1 (from scratch).

    ``step`` is clamped to ``[0, total_steps]``; ``exp`` needs ``total_steps > 0``.
    """
    if name not in TIME_SCALES:
        raise unknown_name_error("layer dropout time scale", name, list(TIME_SCALES))
    if name == "constant":
        return 1.0
    if total_steps is None or total_steps <= 0:
        raise ConfigError(f"Layer dropout time scale 'exp' needs total_steps > 0, got {total_steps}.")
    frac = min(max(step, 0), total_steps) / total_steps
    return 2.0**frac - 1.0


_time_scale = time_scale  # dropout_rates' argument of the same name shadows the function


def dropout_rates(
    p_max: float,
    num_layers: int,
    layers_spec: str | Sequence[int] | None = None,
    *,
    scale: str = "exp",
    time_scale: str = "constant",
    step: int = 0,
    total_steps: int | None = None,
) -> list[float]:
    """Per-layer drop rates ``p_max * S(step) * D(l)`` for the selected layers, 0 elsewhere. Length ``L``."""
    if not 0.0 <= p_max < 1.0:
        raise ConfigError(f"layer_dropout.prob (p_max) must be in [0, 1), got {p_max}.")
    selected = set(parse_layers(layers_spec, num_layers))
    s_t = _time_scale(time_scale, step, total_steps)
    d = depth_scale(scale, num_layers)
    return [p_max * s_t * d[layer] if layer in selected else 0.0 for layer in range(num_layers)]


# --------------------------------------------------------------------------------------------------------
# Draws
DROP_STREAM = "layer-dropout"  # the draw stream of the drop masks (fastdecode.training.draws)


def drop_mask(
    rates: Sequence[float] | torch.Tensor,
    batch_size: int,
    *,
    seed: int,
    step: int,
    micro_step: int = 0,
    rank: int = 0,
) -> torch.Tensor:
    """Per-sample drops ``[L, B]`` bool (True = row b skips layer l), on the CPU.

    Drawn from a private ``torch.Generator`` keyed by ``(seed, step, micro_step, rank)``, so the mask depends
    only on its arguments (not on the global RNG) and a resumed run redraws the same drops. ``micro_step``
    (gradient accumulation index) and ``rank`` (data-parallel rank) decorrelate the micro-batches of a step.
    """
    rates_t = torch.as_tensor(rates, dtype=torch.float64).reshape(-1, 1)  # [L, 1]
    gen = draw_generator(DROP_STREAM, seed, step, micro_step, rank)
    uniform = torch.rand(rates_t.shape[0], batch_size, generator=gen, dtype=torch.float64)  # [L, B]
    return uniform < rates_t


# --------------------------------------------------------------------------------------------------------
# Forward with per-sample drops
def plan_segments(
    drops: torch.Tensor | None, exits: set[int], last: int
) -> list[tuple[int, int, list[int] | None]]:
    """How to run layers ``0..last``: ``(start, end, kept_rows)`` per segment.

    ``kept_rows`` None: all rows run ``[start, end)`` (fast path: consecutive drop-free layers are merged
    until an exit); a list: only those rows run the single layer ``start``; ``[]``: every row skips it.
    ``drops``: ``[L, B]`` bool on the CPU, or None for no dropout.
    """
    segments: list[tuple[int, int, list[int] | None]] = []
    for layer in range(last + 1):
        row = drops[layer] if drops is not None else None
        if row is None or not bool(row.any()):
            prev = segments[-1] if segments else None
            if prev is not None and prev[2] is None and prev[1] == layer and layer - 1 not in exits:
                segments[-1] = (prev[0], layer + 1, None)
            else:
                segments.append((layer, layer + 1, None))
        else:
            segments.append((layer, layer + 1, (~row).nonzero().flatten().tolist()))
    return segments


def _first_row(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x[:1]


def _rows(x: torch.Tensor | None, kept: torch.Tensor, batch: int) -> torch.Tensor | None:
    """``x`` restricted to rows ``kept``; None and tensors broadcast over the batch pass through."""
    if x is None or x.shape[0] != batch:
        return x
    return x.index_select(0, kept.to(x.device))


def run_with_layer_dropout(
    m: EarlyExitModel,
    hidden: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    drops: torch.Tensor | None = None,
    exit_layers: Sequence[int] | set[int] | None = None,
    touch_skipped: bool = False,
) -> dict[int, torch.Tensor]:
    """Run the decoder blocks with per-sample layer dropout; return the residual stream at each exit.

    Args:
        m: the model (``EarlyExitModel``).
        hidden: ``[B, T, H]`` embeddings (``m.embed``).
        position_ids: ``[B, T]`` (or ``[1, T]``, broadcast).
        attention_mask: additive ``[B, 1, T, S]`` (or ``[1, 1, T, S]``), or None for plain causal.
        drops: ``[L, B]`` bool, True = row skips the layer (:func:`drop_mask`); None = no dropout.
        exit_layers: blocks whose output is wanted ("exit after block l"); default the last one only.
            Layers past the deepest exit are not run.
        touch_skipped: run a layer that every row skips on one row anyway, with zero weight, so its
            parameters get zero gradients instead of none (DDP, ZeRO-3 gather hooks).

    Returns:
        ``{l: [B, T, H]}``: the residual stream after block ``l`` (after its drops) for each exit.

    A layer that some rows drop runs only on the kept rows (rows, positions and mask rows selected
    together) and its output is scattered back; dropped rows pass through unchanged (no rescale).
    Pitfall: a layer that *every* row drops gets no gradient. DDP without ``find_unused_parameters=True``
    then raises at the next forward; pass ``touch_skipped=True`` to give it zero gradients instead (tested
    with 2 processes). The layer really runs on one row (its output times zero), so ZeRO-3/FSDP gather its
    parameters as usual and the engines see every parameter used; it costs one row of one layer, only when
    every row drops that layer (probability p^B). Under DDP, call this (and the loss) inside
    the forward of the DDP-wrapped module: calling the model on ``ddp.module`` directly bypasses the
    reducer and the gradients are silently not all-reduced.
    """
    exits, drops = _checked(m.num_layers, hidden.shape[0], exit_layers, drops)
    out: dict[int, torch.Tensor] = {}
    for start, end, kept in plan_segments(drops, exits, max(exits)):
        if kept is None:  # fast path: every row runs [start, end)
            hidden = m.run_layers(hidden, start, end, position_ids, attention_mask)
        elif kept:  # some rows drop this layer: run it on the kept rows only
            hidden = _run_kept_rows(m, hidden, (start, end), kept, position_ids, attention_mask)
        elif touch_skipped:  # every row drops it: a zero-weighted "ghost" run of one row
            ghost = m.run_layers(hidden[:1], start, end, position_ids[:1], _first_row(attention_mask))
            hidden = hidden + (ghost * 0).sum().to(hidden.dtype)
        if end - 1 in exits:
            out[end - 1] = hidden
    return out


def _checked(
    num_layers: int, batch: int, exit_layers: Sequence[int] | set[int] | None, drops: torch.Tensor | None
) -> tuple[set[int], torch.Tensor | None]:
    """The exits (default: the last layer) and ``drops`` as ``[L, B]`` bool on the CPU, both checked."""
    exits = {num_layers - 1} if exit_layers is None else set(exit_layers)
    if not exits or not all(0 <= e < num_layers for e in exits):
        raise ValueError(f"exit_layers {sorted(exits)} must be non-empty and within 0..{num_layers - 1}")
    if drops is not None:
        if tuple(drops.shape) != (num_layers, batch):
            raise ValueError(f"drops must be [L={num_layers}, B={batch}], got {tuple(drops.shape)}")
        drops = drops.to("cpu", torch.bool)
    return exits, drops


def _run_kept_rows(
    m: EarlyExitModel,
    hidden: torch.Tensor,
    span: tuple[int, int],
    kept: list[int],
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Layers ``span`` on the rows ``kept`` of ``hidden [B, T, H]`` (rows, positions and mask rows selected
    together), scattered back; the other rows pass through unchanged."""
    batch = hidden.shape[0]
    idx = torch.tensor(kept, device=hidden.device)
    part = m.run_layers(
        hidden.index_select(0, idx),  # [K, T, H]
        *span,
        _rows(position_ids, idx, batch),  # [K, T]
        _rows(attention_mask, idx, batch),  # [K, 1, T, S]
    )
    return hidden.index_copy(0, idx, part.to(hidden.dtype))  # dropped rows: identity
