"""``Eagle3Trainer``: the HF Trainer with the TTT loss normalised over the whole accumulated batch and its
per-step metrics (``loss_k``, ``acc_k``) in its logs.

Normalisation under gradient accumulation (``fastdecode.training.accumulated``, as ``cllm_train/trainer.py``):
the loss of every micro-batch is its sum over step 0's scored positions divided by the count of the *whole
accumulated batch* (``step0_items``, summed over ranks when ``average_tokens_across_devices``).
"""

from __future__ import annotations

import torch

from eagle3_train.module import step0_items
from fastdecode.training.accumulated import AccumulatedLossTrainer


class Eagle3Trainer(AccumulatedLossTrainer):
    """Overrides ``get_batch_samples`` only: count the accumulated batch's scored positions."""

    items_key = "scored_items"

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        count = sum((step0_items(b) for b in batches), torch.zeros((), dtype=torch.long))
        self.set_items(count, device, 1)
        return batches, num_items
