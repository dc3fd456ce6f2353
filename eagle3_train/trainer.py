"""``Eagle3Trainer``: the HF Trainer with the TTT loss's per-step metrics (``loss_k``, ``acc_k``) in its logs."""

from __future__ import annotations

import torch
from transformers import Trainer


class Eagle3Trainer(Trainer):
    """Overrides ``compute_loss`` (keeps the module's per-step metrics) and ``log`` (adds their means) only.

    The metrics stay tensors on the training device until a log is written: no host sync per step.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        if model.training:
            module = self.accelerator.unwrap_model(model)
            for key, value in module.last_metrics.items():
                self._sums[key] = self._sums[key] + value if key in self._sums else value.detach().clone()
            self._count += 1
        loss = outputs["loss"]
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._count and "loss" in logs:
            logs = logs | {k: round(float(v) / self._count, 4) for k, v in sorted(self._sums.items())}
            self._sums, self._count = {}, 0
        super().log(logs, *args, **kwargs)
