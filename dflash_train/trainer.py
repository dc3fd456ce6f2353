"""``DFlashTrainer``: the HF Trainer with the step's anchors drawn before its micro-batches run, the DFlash loss
normalised over the whole accumulated batch, and the per-slot metrics (``acc_k``, ``accept_len``) in its logs.

Anchors are a pure function of ``(seed, step, rank, row of the accumulated batch)`` (``training.draws``): a
resumed run draws what an uninterrupted one would, micro-batches what one batch would. As in
``eagle3_train/trainer.py``, each micro-batch's weighted loss sum is divided by the slot weight of the whole
accumulated batch (summed over ranks with ``average_tokens_across_devices``); ``compute_loss`` undoes the
ranks' gradient averaging."""

from __future__ import annotations

import torch
from transformers import Trainer

from dflash_train.losses import anchor_positions, anchor_weight_sum
from fastdecode.training.draws import draw_generator

ANCHOR_STREAM = "dflash-anchors"


class DFlashTrainer(Trainer):
    """Overrides ``get_batch_samples`` (draw each micro-batch's anchors, sum the step's slot weight),
    ``compute_loss`` (pass that sum; keep the module's metrics) and ``log`` (adds their means) only.

    The metrics stay tensors on the training device until a log is written: no host sync per step.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loss_is_scaled_for_ga = True  # every micro-batch's loss is already over the whole step's weight
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0
        self._items: torch.Tensor | None = None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        module = self.accelerator.unwrap_model(self.model)
        cfg, block = module.loss_cfg, module.block
        total, offset = torch.zeros((), dtype=torch.float32), 0
        for batch in batches:
            rows = range(offset, offset + batch["response"].shape[0])
            anchors, keep = anchor_positions(batch["response"], cfg["num_anchors"], self.row_generators(rows))
            batch["anchors"], batch["keep"] = anchors, keep
            weight = anchor_weight_sum(anchors, keep, batch["response"], block=block, gamma=cfg["gamma"])
            total, offset = total + weight.cpu(), rows.stop
        total = total.to(device)
        if self._across_ranks():
            total = self.accelerator.gather(total).sum()
        self._items = total.clamp(min=1e-6)
        return batches, num_items

    def row_generators(self, rows: range) -> list[torch.Generator]:
        """One generator per row of this step's accumulated batch: ``(seed, step, rank, row)``, so splitting
        the step into micro-batches changes no anchor."""
        key = (self.args.seed, self.state.global_step, self.args.process_index)
        return [draw_generator(ANCHOR_STREAM, *key, row) for row in rows]

    def _across_ranks(self) -> bool:
        return bool(self.args.average_tokens_across_devices) and self.args.world_size > 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training and self._items is not None:
            inputs = {**inputs, "weight_items": self._items}
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
