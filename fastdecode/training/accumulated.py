"""A Trainer whose loss the module normalises over the whole accumulated batch, with the module's metrics in
its logs: the base of the feature-cache recipes' trainers (``eagle3_train``, ``dflash_train``).

A subclass counts the step's normaliser in ``get_batch_samples`` (``set_items``); every micro-batch's module
call receives it as ``items_key``, so 4 micro-batches of 2 give the gradient of one batch of 8. The Trainer
then neither divides by the accumulation steps nor, the loss being its own, multiplies by the ranks:
``compute_loss`` does that. Metrics stay tensors on the device until a log is written (no host sync per step).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import Trainer


class AccumulatedLossTrainer(Trainer):
    """Overrides ``compute_loss`` (pass the step's normaliser; keep the module's ``last_metrics``) and ``log``
    (adds their means). ``items_key``: the module's keyword for the normaliser."""

    items_key: ClassVar[str] = "items"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loss_is_scaled_for_ga = True  # every micro-batch's loss is already over the whole step's count
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0
        self._items: torch.Tensor | None = None

    def across_ranks(self) -> bool:
        """Whether the normaliser is summed over ranks (as the Trainer does for ``num_items_in_batch``)."""
        return bool(self.args.average_tokens_across_devices) and self.args.world_size > 1

    def set_items(self, total: torch.Tensor, device: torch.device, floor: float) -> None:
        """The step's normaliser ``total`` (this rank's), summed over ranks when they average, at least
        ``floor``."""
        total = total.to(device)
        if self.across_ranks():
            total = self.accelerator.gather(total).sum()
        self._items = total.clamp(min=floor)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training and self._items is not None:
            inputs = {**inputs, self.items_key: self._items}
        outputs = model(**inputs)
        loss = outputs["loss"]
        if model.training:
            module = self.accelerator.unwrap_model(model)
            for key, value in module.last_metrics.items():
                self._sums[key] = self._sums[key] + value if key in self._sums else value.detach().clone()
            self._count += 1
            if self._items is not None and self.across_ranks():
                loss = loss * self.accelerator.num_processes  # ranks' gradients are averaged, not summed
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._count and "loss" in logs:
            logs = logs | {k: round(float(v) / self._count, 4) for k, v in sorted(self._sums.items())}
            self._sums, self._count = {}, 0
        super().log(logs, *args, **kwargs)
