"""LayerSkip early-exit loss: every active exit shares the final norm and LM head, ``J = sum_l w_l CE_l``.

``early_exit_loss`` computes it exit by exit, in chunks of ``chunk_size`` label tokens whose logits are
recomputed in backward, so peak logits memory is one chunk. ``scale_weights`` and ``active_exits`` give the
exits' weights and curriculum. Labels follow the Hugging Face convention (not shifted; ``-100`` ignored).
The memory scheme and the normalisation: docs/design/methods.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.tokens import IGNORE_INDEX, next_token_targets

DEFAULT_CHUNK_SIZE = 1024  # label tokens per head+CE chunk: logits memory ~ chunk_size * V * 4 bytes (x2-3)

_SCALES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "uniform": torch.ones_like,
    "linear_l": lambda n: n,
    "sum_l": lambda n: torch.cumsum(n, 0),
    "sqrt_l": torch.sqrt,
    "inv_l": torch.reciprocal,
    "inv_sqrt_l": torch.rsqrt,
}
CURRICULA = ("none", "rotational", "strided", "gradual")
CURRICULUM_ALIASES = {"rot": "rotational"}  # torchtune's EarlyExitCurriculumType value


# --------------------------------------------------------------------------------------------------------
# Weights and curricula (pure functions of the step)
def scale_weights(
    name: str, exit_layers: Sequence[int], num_layers: int, e_scale: float = 1.0
) -> list[float]:
    """Normalised exit weights ``w = s / sum(s)``, aligned with ``exit_layers`` (strictly increasing).

    ``s`` per exit of 0-based block ``l`` (torchtune's names): ``uniform`` 1, ``linear_l`` l+1, ``sum_l``
    cumsum of (l+1) over the given exits, ``sqrt_l`` sqrt(l+1), ``inv_l`` 1/(l+1), ``inv_sqrt_l``
    1/sqrt(l+1); every exit other than the last layer ``L - 1`` is multiplied by ``e_scale``.
    """
    if name not in _SCALES:
        raise unknown_name_error("early exit scale function", name, list(_SCALES))
    layers = list(exit_layers)
    if not layers or any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
        raise ConfigError(f"exit layers must be non-empty and strictly increasing, got {layers}.")
    if not all(0 <= layer < num_layers for layer in layers):
        raise ConfigError(f"exit layers {layers} must lie in 0..{num_layers - 1}.")
    if not e_scale > 0:
        raise ConfigError(f"early_exit_loss.scale (e_scale) must be > 0, got {e_scale}.")
    ids = torch.tensor(layers, dtype=torch.float64)  # [E]
    s = _SCALES[name](ids + 1)
    s = s * torch.where(ids < num_layers - 1, e_scale, 1.0)
    return (s / s.sum()).tolist()


def active_exits(
    curriculum: str,
    candidate_layers: Sequence[int],
    num_layers: int,
    step: int,
    total_steps: int | None = None,
    *,
    stride: int = 4,
) -> list[int]:
    """Exits trained at optimiser step ``step`` (0-based: the first step is 0), sorted; the last is always in.

    Numbering: ``candidate_layers`` (``early_exit_loss.layers``) and the result are 0-based blocks, "exit
    after block ``l``"; block ``L - 1`` is the model's own output. The trainer logs exit ``l`` as
    ``loss/exit_{l + 1}`` (``E = l + 1`` blocks run), the same ``E`` as ``recipe.exit_layer`` and
    ``generation_config.assistant_early_exit``: ``layers: "9,18,24"`` logs ``loss/exit_10``,
    ``loss/exit_19``, ``loss/exit_25`` and ``loss/exit_L``. (torchtune's ``TransformerDecoder`` records the
    hidden state *entering* block ``i`` for its index ``i``, one block less, which leaves its last block
    without gradient; the curricula below act on indices alone, so their masks are the same.)

    - ``none``: every candidate.
    - ``rotational`` (torchtune's ``RotationalEarlyExitCurriculum``, also spelt ``rot`` as there): the
      candidate mask over the ``L`` layers rolled by one layer per optimiser step, with wrap-around
      (``np.roll(mask, step)``): exit ``(l + step) mod L`` for each candidate ``l``. ``"0::4"`` trains
      {0, 4, 8, ...} at step 0 and {1, 5, 9, ...} at step 1; ``":"`` trains every exit at every step.
      A candidate ``L - 1`` rolls on to layer 0 like any other (torchtune forces the last layer on in
      ``get()``, on a copy, so the forced bit never rolls).
    - ``strided`` (fastdecode's own, no torchtune counterpart): candidate ``l`` iff
      ``(l - step) mod stride == 0``; ``":"`` with stride 4 trains about ``L / 4`` exits a step. Over
      sparse candidates it can leave steps with only the last exit (``"9,18,24"``, stride 4: every
      fourth step).
    - ``gradual``: candidate ``l`` iff ``step / total_steps >= 0.5 * (L - l) / L`` (deepest exits first,
      layer 0 from half-way on). It differs from torchtune's ``GradualEarlyExitCurriculum`` in two ways:
      torchtune restarts it from the last layer alone on resume (it resets its step counter), and its
      ``step()`` tests the fraction before counting the step, so each exit joins there one optimiser step
      later than here.

    Every curriculum is a pure function of the global step, so a resumed run trains exactly the exits the
    uninterrupted run would have (torchtune's resume restarts its curricula: the rotational mask from its
    initial position, the gradual one from the last layer alone).
    """
    curriculum = CURRICULUM_ALIASES.get(curriculum, curriculum)
    if curriculum not in CURRICULA:
        raise unknown_name_error("early exit curriculum", curriculum, list(CURRICULA))
    last = num_layers - 1
    if curriculum == "none":
        chosen = set(candidate_layers)
    elif curriculum == "rotational":
        chosen = {(layer + step) % num_layers for layer in candidate_layers}
    elif curriculum == "strided":
        if stride < 1:
            raise ConfigError(f"strided curriculum needs stride >= 1, got {stride}.")
        chosen = {layer for layer in candidate_layers if (layer - step) % stride == 0}
    else:
        if total_steps is None or total_steps <= 0:
            raise ConfigError(f"gradual curriculum needs total_steps > 0, got {total_steps}.")
        # step/T >= 0.5 (L - l)/L  <=>  2 step L >= T (L - l), in integers (no rounding at the boundary)
        chosen = {
            layer for layer in candidate_layers if 2 * step * num_layers >= total_steps * (num_layers - layer)
        }
    return sorted(chosen | {last})


# --------------------------------------------------------------------------------------------------------
# Loss
@dataclass(frozen=True)
class SelfDistill:
    """Self-distillation of the early exits towards the final exit.

    Exit loss ``(1 - weight) * CE(labels) + weight * T^2 * KL(p_final^T || p_exit^T)`` where ``p^T`` is the
    softmax at temperature ``T`` and ``p_final`` is detached; the final exit keeps plain CE.
    """

    weight: float
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight <= 1.0:
            raise ConfigError(f"distillation weight must be in [0, 1], got {self.weight}.")
        if not self.temperature > 0:
            raise ConfigError(f"distillation temperature must be > 0, got {self.temperature}.")


@dataclass
class ExitLoss:
    """``loss``: the scalar to backpropagate; ``ce``/``kl``: detached per-exit means over label tokens."""

    loss: torch.Tensor
    ce: dict[int, torch.Tensor]
    kl: dict[int, torch.Tensor]
    num_tokens: int


def _chunk_losses(
    m: EarlyExitModel,
    flat: torch.Tensor,
    idx: torch.Tensor,
    target: torch.Tensor,
    teacher: torch.Tensor | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed CE and KL of one chunk: ``flat [N_all, H]``, ``idx``/``target [C]`` -> two scalars."""
    logits = m.exit_logits(flat.index_select(0, idx)).float()  # [C, V]
    ce = F.cross_entropy(logits, target, reduction="sum")
    if teacher is None:
        return ce, ce.new_zeros(())
    with torch.no_grad():
        log_p_t = F.log_softmax(m.exit_logits(teacher.index_select(0, idx)).float() / temperature, -1)
    log_p_s = F.log_softmax(logits / temperature, -1)  # [C, V]
    kl = F.kl_div(log_p_s, log_p_t, reduction="sum", log_target=True) * temperature**2
    return ce, kl


def _exit_sums(
    m: EarlyExitModel,
    hidden: torch.Tensor,
    chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    teacher: torch.Tensor | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed CE and KL of one exit over ``chunks`` of (token indices, targets) of ``hidden [B, T, H]``."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B*T, H], a view
    ce = kl = hidden.new_zeros((), dtype=torch.float32)
    for idx, target in chunks:  # idx, target: [C]
        args = (m, flat, idx, target, teacher, temperature)
        if torch.is_grad_enabled():
            c, k = checkpoint(_chunk_losses, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            c, k = _chunk_losses(*args)
        ce, kl = ce + c, kl + k
    return ce, kl


def _chunks(
    valid: torch.Tensor, targets: torch.Tensor, chunk_size: int, num_chunks: int | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split label tokens into chunks of ``chunk_size``, or into exactly ``num_chunks`` (some maybe empty).

    A fixed number of chunks makes the sequence of head calls identical on every rank whatever its label
    count, which ZeRO-3's parameter prefetch requires (it checks the module trace across ranks).
    """
    if num_chunks is None:
        num_chunks = max(1, -(-valid.numel() // chunk_size))
    return list(
        zip(torch.tensor_split(valid, num_chunks), torch.tensor_split(targets, num_chunks), strict=True)
    )


def _distills(distill: SelfDistill | None) -> bool:
    return distill is not None and distill.weight > 0


def _exit_weights(
    layers: list[int],
    weights: Sequence[float] | Mapping[int, float],
    *,
    chunk_size: int,
    needs_last: bool,
    last: int,
) -> dict[int, float]:
    """``{exit: weight}`` from a mapping or a sequence aligned with ``layers``; the arguments checked."""
    w = dict(weights) if isinstance(weights, Mapping) else dict(zip(layers, weights, strict=True))
    if set(w) != set(layers):
        raise ValueError(f"weights are for exits {sorted(w)}, hidden states for {layers}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if needs_last and last not in layers:
        raise ValueError(f"self-distillation needs the final exit {last} among the hidden states")
    return w


def _label_tokens(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The scored positions of HF-style ``labels [B, T]`` flattened (``valid [N]``: position t scores label
    t+1), their targets ``[N]`` and N. With no label token: one ignored dummy position (the caller zeroes the
    loss), so the norm and head stay in the graph."""
    shifted = next_token_targets(labels).reshape(-1)  # [B*T]: position t -> label t+1
    valid = (shifted != IGNORE_INDEX).nonzero().flatten()  # [N]
    n = valid.numel()
    if n == 0:
        valid = torch.zeros(1, dtype=torch.long, device=labels.device)
    return valid, shifted.index_select(0, valid), n


def early_exit_loss(
    m: EarlyExitModel,
    hiddens: Mapping[int, torch.Tensor],
    labels: torch.Tensor,
    weights: Sequence[float] | Mapping[int, float],
    *,
    num_items: int | torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    distill: SelfDistill | None = None,
    num_chunks: int | None = None,
    token_fraction: float = 1.0,
    generator: torch.Generator | None = None,
) -> ExitLoss:
    """Weighted early-exit loss ``sum_l w_l * loss_l``, chunked and recomputed (docs/design/methods.md).

    Args:
        m: the model (``EarlyExitModel``: final norm + shared LM head).
        hiddens: ``{l: [B, T, H]}`` residual stream after block ``l`` (``run_with_layer_dropout``).
        labels: ``[B, T]`` HF-style, aligned with the inputs (shifted here); ``-100`` ignored.
        weights: per exit, a mapping ``{l: w}`` or a sequence aligned with ``sorted(hiddens)``
            (``scale_weights``); used as given (not renormalised).
        num_items: label tokens in the whole accumulated batch (Trainer's ``num_items_in_batch``): the
            loss is ``sum / num_items``; None: mean over this batch's label tokens.
        chunk_size: label tokens per recomputed head+CE chunk.
        distill: optional self-distillation of the non-final exits (needs the last layer in ``hiddens``).
        num_chunks: split the label tokens into exactly this many chunks instead (same head-call sequence on
            every rank: needed under ZeRO-3).
        token_fraction: for the non-final exits, score only this random fraction of the label tokens
            (drawn with ``generator``), scaled by ``n / kept``: an unbiased estimate of the full exit loss at
            a fraction of the LM-head cost. 1.0 (default) is the exact loss.
    """
    layers, last = sorted(hiddens), m.num_layers - 1
    w = _exit_weights(layers, weights, chunk_size=chunk_size, needs_last=_distills(distill), last=last)
    valid, targets, n = _label_tokens(labels)
    chunks = _chunks(valid, targets, chunk_size, num_chunks)
    teacher = None
    if _distills(distill):
        teacher = hiddens[last].detach().reshape(-1, hiddens[last].shape[-1])  # [B*T, H]
    total = hiddens[layers[0]].new_zeros((), dtype=torch.float32)
    ce_log: dict[int, torch.Tensor] = {}
    kl_log: dict[int, torch.Tensor] = {}
    temp = distill.temperature if distill is not None else 1.0
    for layer in layers:
        t = teacher if layer != last else None
        sub, scale = chunks, 1.0
        if layer != last and token_fraction < 1.0 and n > 0:  # an unbiased estimate from a token subset
            keep = max(1, math.ceil(token_fraction * n))
            pick = torch.randperm(n, generator=generator)[:keep].sort().values.to(valid.device)
            sub, scale = _chunks(valid[pick], targets[pick], chunk_size, num_chunks), n / keep
        ce, kl = (x * scale for x in _exit_sums(m, hiddens[layer], sub, t, temp))
        alpha = distill.weight if t is not None else 0.0
        total = total + w[layer] * (ce if alpha == 0 else (1 - alpha) * ce + alpha * kl)
        ce_log[layer] = ce.detach() / max(n, 1)
        if t is not None:
            kl_log[layer] = kl.detach() / max(n, 1)
    if n == 0:  # zero loss, zero (not missing) gradients: DDP still sees every parameter used
        total = total * 0
    denom = num_items if num_items is not None else max(n, 1)
    return ExitLoss(loss=total / denom, ce=ce_log, kl=kl_log, num_tokens=n)
