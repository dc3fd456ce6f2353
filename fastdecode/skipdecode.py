"""SkipDecode (Del Corro et al., 2023): its options, the per-position layer budget and its exact teacher-forced
forward, and the record of the policy a checkpoint was trained with.

The training recipe (``skipdecode_train``) and the decoder (``fastdecode/decoding/skipdecode.py``) share this
module, so both read the same options (``SkipOptions``) and run the same layers (``SkipDecodePolicy``). The
budget formula, batching and why no KV is recomputed: docs/design/core.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from fastdecode.config import ConfigError, to_dataclass
from fastdecode.files.io import atomic_write_json
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.tokens import IGNORE_INDEX

SKIPDECODE_FILE = "skipdecode.json"  # the trained policy, in a checkpoint directory


@dataclass
class SkipOptions:
    """SkipDecode's four options, one meaning each, for training (``recipe.*`` of
    ``configs/recipe/skipdecode.yaml``, through ``skipdecode_train.config.SkipDecodeConfig``) and decoding
    (``decoder.skip.*``, ``DecodeConfig.skip``); ``policy`` makes them a model's ``SkipDecodePolicy``.

    - ``max_budget``: layers at the first response token; None: all layers.
    - ``min_budget``: layers at ``max_length`` and after; None: half the layers (at least
      ``warmup_layers + 1``, at most ``max_budget``).
    - ``warmup_layers``: bottom layers every token runs; None: 1.
    - ``max_length``: the position T (prompt included) where the budget reaches ``min_budget``; None: the
      longest sequence of the run (training: ``data.max_length``; decoding: the longest prompt of the batch
      + ``max_new_tokens``).

    None is "not chosen", so the value above is the default. A checkpoint trained with ``recipe=skipdecode``
    records its policy (``skipdecode.json``) and that is its default: decoding it, an option left None takes
    the trained value and an option that is set must equal it (``trained_options``).
    """

    KEYS: ClassVar[str] = "decoder.skip."  # where the options sit in the config, for messages

    max_budget: int | None = None
    min_budget: int | None = None
    warmup_layers: int | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        low, high, k = self.min_budget, self.max_budget, self.KEYS
        if low is not None and high is not None and low > high:
            raise ConfigError(f"{k}min_budget={low} > {k}max_budget={high}: must be <=.")

    def policy(self, num_layers: int, max_length: int) -> SkipDecodePolicy:
        """The validated policy of these options for a model of ``num_layers`` layers; ``max_length``: T when
        the options leave it None (the longest sequence of the run)."""
        warmup = 1 if self.warmup_layers is None else self.warmup_layers
        high = num_layers if self.max_budget is None else self.max_budget
        low = min(high, max(warmup + 1, num_layers // 2)) if self.min_budget is None else self.min_budget
        return SkipDecodePolicy(
            num_layers=num_layers,
            max_budget=high,
            min_budget=low,
            warmup_layers=warmup,
            max_length=max_length if self.max_length is None else self.max_length,
            keys=self.KEYS,
        )


@dataclass(frozen=True)
class SkipDecodePolicy:
    """A validated SkipDecode policy for a model of ``num_layers`` decoder layers.

    ``keys`` is the config prefix used in error messages (``"recipe."``, ``"decoder.skip."``).
    """

    num_layers: int
    max_budget: int
    min_budget: int
    warmup_layers: int = 1
    max_length: int = 2048
    keys: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        big_l, w, k = self.num_layers, self.warmup_layers, self.keys
        if not 0 <= w < big_l:
            raise ConfigError(
                f"{k}warmup_layers={w} but the model has {big_l} layers: use 0 <= warmup_layers <= {big_l - 1} "
                "(at least one top layer must run after the warm-up)."
            )
        if self.min_budget > self.max_budget:
            raise ConfigError(
                f"{k}min_budget={self.min_budget} > {k}max_budget={self.max_budget}: the budget decays from "
                "max to min, and a rising budget would need keys/values that were never computed; "
                f"set {k}min_budget <= {k}max_budget."
            )
        for name in ("max_budget", "min_budget"):
            value = getattr(self, name)
            if not w + 1 <= value <= big_l:
                raise ConfigError(
                    f"{k}{name}={value} is outside [{w + 1}, {big_l}] = [warmup_layers + 1, layers]: every "
                    f"token runs the {w} warm-up layer(s) and at least the top layer, at most all {big_l}."
                )
        if self.max_length < 1:
            raise ConfigError(f"{k}max_length={self.max_length}: must be >= 1 (tokens).")

    def options(self) -> SkipOptions:
        """The options that give this policy back (every one set): what a checkpoint records."""
        return SkipOptions(self.max_budget, self.min_budget, self.warmup_layers, self.max_length)

    # ----------------------------------------------------------------------------------------------------
    # Budgets
    def check_prompt(self, prompt_len: int) -> None:
        """The budget decays between the prompt end and ``max_length``: the prompt must be shorter."""
        if prompt_len >= self.max_length:
            raise ConfigError(
                f"{self.keys}max_length={self.max_length} but the longest prompt has {prompt_len} tokens: "
                f"the budget decays from the prompt end to max_length, so raise {self.keys}max_length "
                f"above {prompt_len} (or shorten the prompts)."
            )

    def response_budgets(self, num_offsets: int, prompt_len: int) -> torch.Tensor:
        """Budgets ``[num_offsets]`` (long) of response offsets ``k = 0 ..`` after a prompt of ``prompt_len``.

        Integer half-up rounding, so training and decoding (and every platform) agree exactly.
        """
        self.check_prompt(prompt_len)
        span = self.max_length - prompt_len
        k = torch.arange(num_offsets, dtype=torch.long)
        drop = (2 * (self.max_budget - self.min_budget) * k + span) // (2 * span)  # round(d * k / span)
        return (self.max_budget - drop).clamp(min=self.min_budget)

    def budgets(self, prompt_len: int, total_len: int) -> torch.Tensor:
        """Budgets ``[total_len]`` (long) of positions ``0 .. total_len-1``: the prompt at full depth."""
        response = self.response_budgets(max(0, total_len - prompt_len), prompt_len)
        prompt = torch.full((min(prompt_len, total_len),), self.num_layers, dtype=torch.long)
        return torch.cat([prompt, response])

    def row_budgets(self, response_starts: torch.Tensor, length: int) -> torch.Tensor:
        """Budgets ``[B, length]`` of right-padded rows whose responses start at ``response_starts [B]``.

        Offsets count from each row's own start; the span uses the batch's latest start
        (docs/design/core.md).
        """
        starts = response_starts.long().cpu()
        answered = starts[starts < length]  # rows without a label are all prompt and do not set the span
        table = self.response_budgets(length, int(answered.max()) if len(answered) else 0)  # [length]
        offset = torch.arange(length)[None, :] - starts[:, None]  # [B, length]
        budgets = table[offset.clamp(min=0, max=length - 1)]
        return torch.where(offset < 0, self.num_layers, budgets)

    # ----------------------------------------------------------------------------------------------------
    # Layers
    def layer_ranges(self, budget: int) -> tuple[range, range]:
        """(warm-up layers, top layers) run at ``budget``: ``range(0, w)`` and ``range(L-(b-w), L)``."""
        if not self.min_budget <= budget <= self.num_layers:
            raise ValueError(f"budget {budget} outside [{self.min_budget}, {self.num_layers}]")
        w = self.warmup_layers
        return range(0, w), range(self.num_layers - (budget - w), self.num_layers)

    def runs_layer(self, budgets: torch.Tensor) -> torch.Tensor:
        """``[L, *budgets.shape]`` bool: whether each layer runs at each budget entry."""
        layer = torch.arange(self.num_layers, device=budgets.device).view(-1, *([1] * budgets.dim()))
        top_start = self.num_layers - (budgets - self.warmup_layers)
        return (layer < self.warmup_layers) | (layer >= top_start[None])


def response_starts(labels: torch.Tensor) -> torch.Tensor:
    """``[B]``: the first labelled position of each row of ``labels [B, T]`` (T for a row with no label).

    HF convention: ``labels[t]`` is the token at ``t``, so the first label is the first response token, the
    one a decoder generates from the prompt ``input_ids[:start]``.
    """
    labelled = labels != IGNORE_INDEX
    length = labels.shape[1]
    first = torch.where(labelled, torch.arange(length, device=labels.device), length)
    return first.min(dim=1).values


def policy_forward(
    m: EarlyExitModel,
    policy: SkipDecodePolicy,
    hidden: torch.Tensor,
    position_ids: torch.Tensor,
    budgets: torch.Tensor,
) -> torch.Tensor:
    """Teacher-forced decoder stack under per-position ``budgets [B, T]``: ``hidden [B, T, H]`` in and out.

    Exactness trick: for each layer the positions that run it are a prefix of each row (budgets never
    increase), so the layer runs on the prefix only and the suffix's residual stream passes through
    unchanged; causal attention means the prefix never needs the suffix. This equals incremental decoding.
    Rows must be right-padded (padding after the real tokens, whose outputs are ignored): no mask is used,
    so sliding windows stay the adapter's. Consecutive layers with the same prefixes run in one call.
    """
    batch, length = budgets.shape
    runs = policy.runs_layer(budgets.cpu())  # [L, B, T]
    prefix = runs.sum(-1)  # [L, B]: positions of each row that run each layer
    if not torch.equal(runs, torch.arange(length) < prefix[..., None]):
        raise ValueError("budgets must be non-increasing along each row (the layers run form prefixes)")
    position_ids = position_ids.expand(batch, -1)
    start = 0
    for layer in range(1, policy.num_layers + 1):
        if layer < policy.num_layers and torch.equal(prefix[layer], prefix[start]):
            continue
        hidden = _run_on_prefixes(m, hidden, start, layer, position_ids, prefix[start])
        start = layer
    return hidden


def _run_on_prefixes(
    m: EarlyExitModel,
    hidden: torch.Tensor,
    start: int,
    end: int,
    position_ids: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """Layers ``[start, end)`` on the first ``lengths[b]`` positions of each row; the rest unchanged."""
    width = int(lengths.max())
    if width == 0:
        return hidden
    # Rows shorter than ``width`` compute a few extra positions; they are discarded below, and causality
    # keeps them out of the kept positions.
    part = m.run_layers(hidden[:, :width], start, end, position_ids[:, :width])
    keep = torch.arange(width)[None, :] < lengths[:, None]  # [B, width]
    if not bool(keep.all()):
        part = torch.where(keep[..., None].to(hidden.device), part, hidden[:, :width])
    return torch.cat([part, hidden[:, width:]], dim=1) if width < hidden.shape[1] else part


def policy_hidden(
    m: EarlyExitModel,
    policy: SkipDecodePolicy,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Final residual stream ``[B, T, H]`` of right-padded ``input_ids [B, T]`` under the policy.

    Each row's response starts at its first label (``response_starts``); ``position_ids`` default to 0..T-1.
    """
    batch, length = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch, -1)
    budgets = policy.row_budgets(response_starts(labels), length)
    return policy_forward(m, policy, m.embed(input_ids, position_ids), position_ids, budgets)


# --------------------------------------------------------------------------------------------------------
# The trained policy, recorded next to a checkpoint
class SkipPolicyMismatchError(ConfigError):
    """Options that contradict the SkipDecode policy a checkpoint was trained with."""


def save_trained_policy(directory: str | os.PathLike, policy: SkipDecodePolicy) -> Path:
    """Write ``directory/skipdecode.json``: ``{"decoder": "skipdecode", "num_layers": L, "skip": {...}}``, the
    policy ``recipe=skipdecode`` trained with, every option set (``decoder.skip.*`` keys)."""
    path = Path(directory) / SKIPDECODE_FILE
    skip = dataclasses.asdict(policy.options())
    atomic_write_json(path, {"decoder": "skipdecode", "num_layers": policy.num_layers, "skip": skip})
    return path


def read_trained_policy(path: str | os.PathLike) -> SkipOptions:
    """The options of a ``skipdecode.json`` (its ``skip`` mapping); a missing mapping or a misspelt key fails
    naming the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot read the SkipDecode policy ({err}).") from err
    if not isinstance(data, dict) or not isinstance(data.get("skip"), dict):
        raise ConfigError(f"{path}: no SkipDecode policy (a 'skip' mapping) in it.")
    return to_dataclass(SkipOptions, data["skip"], f"{path}: skip")


def trained_policy_file(checkpoint: str | os.PathLike | None, skip_file: str | None = "auto") -> str | None:
    """The ``skipdecode.json`` whose policy a decoder must keep to: ``skip_file``; ``"auto"``: the checkpoint
    directory's own, when it has one (the policy it was trained with); None: none (the options alone)."""
    if skip_file != "auto":
        return skip_file
    own = Path(checkpoint) / SKIPDECODE_FILE if checkpoint else None
    return str(own) if own is not None and own.is_file() else None


def trained_options(
    trained: SkipOptions,
    given: SkipOptions | None,
    *,
    source: str,
    override: str,
    keys: str = SkipOptions.KEYS,
) -> SkipOptions:
    """The options that decode a checkpoint trained with ``trained`` (read from ``source``): an option that
    ``given`` leaves None takes the trained value; one it sets must equal the trained value (or fill one the
    record leaves None). A contradiction raises ``SkipPolicyMismatchError`` naming both values and the fixes;
    ``override`` says how the caller decodes with other options on purpose (without the record)."""
    names = [f.name for f in dataclasses.fields(SkipOptions)]
    recorded = {name: getattr(trained, name) for name in names}
    chosen = {name: getattr(given, name) for name in names if given and getattr(given, name) is not None}
    clashes = {name: value for name, value in chosen.items() if recorded[name] not in (None, value)}
    if clashes:
        shown = "; ".join(
            f"{keys}{name}={value}, trained with {recorded[name]}" for name, value in clashes.items()
        )
        fix = ", ".join(f"{keys}{name}={recorded[name]}" for name in clashes)
        raise SkipPolicyMismatchError(
            f"{shown}: the options contradict the SkipDecode policy the checkpoint was trained with ({source}). "
            f"Leave them unset (null) to decode with the trained policy, or set {fix}; to decode with another "
            f"policy on purpose, {override}."
        )
    return SkipOptions(**recorded | chosen)
