"""``DFlashTrainer``: the HF Trainer with the step's anchors drawn before its micro-batches run, the DFlash loss
normalised over the whole accumulated batch, and the per-slot metrics (``acc_k``, ``accept_len``) in its logs.

Anchors are a pure function of ``(seed, step, rank, row of the accumulated batch)`` (``training.draws``): a
resumed run draws what an uninterrupted one would, micro-batches what one batch would. As in
``eagle3_train/trainer.py`` (``fastdecode.training.accumulated``), each micro-batch's weighted loss sum is divided by the slot weight of the whole
accumulated batch (summed over ranks with ``average_tokens_across_devices``); ``compute_loss`` undoes the
ranks' gradient averaging."""

from __future__ import annotations

import torch

from dflash_train.losses import anchor_positions, anchor_weight_sum
from fastdecode.training.accumulated import AccumulatedLossTrainer
from fastdecode.training.draws import draw_generator

ANCHOR_STREAM = "dflash-anchors"


class DFlashTrainer(AccumulatedLossTrainer):
    """Overrides ``get_batch_samples`` only: draw each micro-batch's anchors, sum the step's slot weight."""

    items_key = "weight_items"

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
        self.set_items(total, device, 1e-6)
        return batches, num_items

    def row_generators(self, rows: range) -> list[torch.Generator]:
        """One generator per row of this step's accumulated batch: ``(seed, step, rank, row)``, so splitting
        the step into micro-batches changes no anchor."""
        key = (self.args.seed, self.state.global_step, self.args.process_index)
        return [draw_generator(ANCHOR_STREAM, *key, row) for row in rows]
