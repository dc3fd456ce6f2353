"""``Eagle3Trainer``: the HF Trainer with the TTT loss normalised over the whole accumulated batch and its
per-step metrics (``loss_k``, ``acc_k``) in its logs.

Normalisation under gradient accumulation (as ``cllm_train/trainer.py``): the loss of every micro-batch is its
sum over step 0's scored positions divided by the count of the *whole accumulated batch* (``step0_items``,
summed over ranks when ``average_tokens_across_devices``, as the Trainer does for ``num_items_in_batch``),
so 4 micro-batches of 2 give the gradient of one batch of 8; the Trainer then neither divides by the
accumulation steps nor, the loss being its own, multiplies by the ranks: ``compute_loss`` does that here.
"""

from __future__ import annotations

import torch
from transformers import Trainer

from eagle3_train.module import step0_items


class Eagle3Trainer(Trainer):
    """Overrides ``get_batch_samples`` (count the accumulated batch's scored positions), ``compute_loss``
    (pass that count; keep the module's per-step metrics) and ``log`` (adds their means) only.

    The metrics stay tensors on the training device until a log is written: no host sync per step.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loss_is_scaled_for_ga = True  # every micro-batch's loss is already over the whole step's count
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0
        self._items: torch.Tensor | None = None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        count = sum((step0_items(b) for b in batches), torch.zeros((), dtype=torch.long)).to(device)
        if self._across_ranks():
            count = self.accelerator.gather(count).sum()
        self._items = count.clamp(min=1)
        return batches, num_items

    def _across_ranks(self) -> bool:
        return bool(self.args.average_tokens_across_devices) and self.args.world_size > 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training and self._items is not None:
            inputs = {**inputs, "scored_items": self._items}
        outputs = model(**inputs)
        loss = outputs["loss"]
        if model.training:
            module = self.accelerator.unwrap_model(model)
            for key, value in module.last_metrics.items():
                self._sums[key] = self._sums[key] + value if key in self._sums else value.detach().clone()
            self._count += 1
            if self._items is not None and self._across_ranks():
                loss = loss * self.accelerator.num_processes  # ranks' gradients are averaged, not summed
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._count and "loss" in logs:
            logs = logs | {k: round(float(v) / self._count, 4) for k, v in sorted(self._sums.items())}
            self._sums, self._count = {}, 0
        super().log(logs, *args, **kwargs)
