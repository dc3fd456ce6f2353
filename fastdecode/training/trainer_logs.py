"""Per-component losses in the Trainer's logs, training and evaluation alike.

A method's module returns the parts of its loss next to ``loss``; ``ComponentLogsMixin`` averages them over
the calls since the last log and adds the means to it (``loss/exit_4``, ``eval_loss/exit_4``), in a fixed
order (``log_order``). Details: docs/design/training.md.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["ComponentLogsMixin", "RunningMeans", "log_order"]


def log_order(names: Iterable[str]) -> list[str]:
    """``names`` grouped by family (the name without its trailing number: ``loss/exit_``, ``kl/exit_``,
    ``loss/consistency``), families in first-seen order, each family's names in increasing number."""
    families: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        match = re.fullmatch(r"(.*?)(\d+)", name)
        family, number = (match.group(1), int(match.group(2))) if match else (name, -1)
        families.setdefault(family, []).append((number, name))
    return [name for members in families.values() for _, name in sorted(members)]


class RunningMeans:
    """Sums and counts of named scalars; ``pop`` returns their means and starts over."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def add(self, values: Mapping[str, float | torch.Tensor]) -> None:
        for name, value in values.items():
            self._sums[name] += float(value)
            self._counts[name] += 1

    def pop(self) -> dict[str, float]:
        """``{name: mean}`` rounded to 4 digits (as the Trainer rounds ``loss``), in ``log_order``; empty when
        nothing was added."""
        means = {name: round(self._sums[name] / self._counts[name], 4) for name in log_order(self._sums)}
        self._sums.clear()
        self._counts.clear()
        return means


class ComponentLogsMixin:
    """Mix into a ``transformers.Trainer`` subclass (before ``Trainer`` in the bases).

    The subclass says which module outputs to log under which names by overriding ``loss_components``.
    ``compute_loss`` collects them (training and evaluation apart), ``log`` adds the training means to each
    training log, ``evaluation_loop`` adds the evaluation means to its metrics with the metric prefix.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._component_means = {"train": RunningMeans(), "eval": RunningMeans()}

    def loss_components(self, outputs: Mapping[str, Any]) -> dict[str, float | torch.Tensor]:
        """``{logged name: scalar}`` from the module's outputs of one call (override)."""
        raise NotImplementedError

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        self._component_means["train" if model.training else "eval"].add(self.loss_components(outputs))
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log (evaluation metrics are prefixed): the means since the last one
            logs.update(self._component_means["train"].pop())
        super().log(logs, start_time)

    def evaluation_loop(
        self,
        dataloader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ):
        self._component_means["eval"].pop()  # nothing from an earlier, interrupted evaluation
        output = super().evaluation_loop(
            dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
        )
        means = self._component_means["eval"].pop()
        output.metrics.update({f"{metric_key_prefix}_{name}": value for name, value in means.items()})
        return output
