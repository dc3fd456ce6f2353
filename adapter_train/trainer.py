"""``AdapterTrainer``: the HF Trainer with the per-exit KL and training-set agreement in its logs."""

from __future__ import annotations

from transformers import Trainer


class AdapterTrainer(Trainer):
    """Overrides ``compute_loss`` (keeps the module's per-exit metrics) and ``log`` (adds their means) only."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sums: dict[str, float] = {}
        self._count = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        module = self.accelerator.unwrap_model(model)
        if model.training:
            for key, value in module.last_metrics.items():
                self._sums[key] = self._sums.get(key, 0.0) + value
            self._count += 1
        loss = outputs["loss"]
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._count and "loss" in logs:
            logs = logs | {k: round(v / self._count, 4) for k, v in self._sums.items()}
            self._sums, self._count = {}, 0
        super().log(logs, *args, **kwargs)
