"""``CLLMTrainer``: the HF Trainer with the CLLM loss.

It overrides only ``get_batch_samples`` (draw the student states of the whole accumulated batch and count its
consistency positions) and ``compute_loss`` (pass that count on). Every token-level loss is divided by the
token count of the whole accumulated batch, so micro-batches give the gradient of one large batch. The
per-loss metrics reach the logs through ``fastdecode.training.trainer_logs``. Details: docs/design/methods.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer

from cllm_train.dataset import draw_states, state_uniforms
from fastdecode.training.trainer_logs import ComponentLogsMixin

METRICS = {  # module output -> logged name
    "loss_consistency": "loss/consistency",
    "loss_ar": "loss/ar",
    "loss_global": "loss/global",  # with consistency_loss=both
    "loss_local": "loss/local",
}


def consistency_count(batch: dict) -> torch.Tensor:
    """Positions ``K`` scored in a batch with ``picks``: ``sum_b (n_b - m_b)`` over rows with a state."""
    rows = torch.arange(len(batch["picks"]), device=batch["picks"].device)
    m = batch["first_mismatch"][rows, batch["picks"].clamp(min=0)]
    return torch.where(batch["picks"] >= 0, batch["block_len"] - m, 0).sum()


class CLLMTrainer(ComponentLogsMixin, Trainer):
    """Trains a ``ConsistencyLM``; logs ``loss/consistency`` and ``loss/ar`` (per-token means; ``eval_...``
    in evaluation).

    Args:
        draw_base: seed of the state draws; row ``j`` of the accumulated batch of optimiser step ``s`` on rank
            ``r`` draws from ``(draw_base, s, r, j)``, so a resumed run draws the same states, and so does the
            same batch split into more micro-batches.
    """

    def __init__(self, *args, draw_base: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.draw_base = draw_base
        self._consistency_items: torch.Tensor | None = None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        step, rank = self.state.global_step, self.args.process_index
        first = 0
        for batch in batches:
            rows = range(first, first + len(batch["block_len"]))  # rows of the accumulated batch
            uniforms = state_uniforms(self.draw_base, step, rank, rows)
            batch["picks"] = draw_states(batch["first_mismatch"], batch["block_len"], uniforms)
            first = rows.stop
        count = sum((consistency_count(b) for b in batches), torch.zeros((), dtype=torch.long)).to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()  # as the Trainer does for num_items_in_batch
        self._consistency_items = count
        return batches, num_items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training and "picks" in inputs:
            inputs = {**inputs, "consistency_items": self._consistency_items}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def loss_components(self, outputs: Mapping[str, Any]) -> dict[str, Any]:
        return {name: outputs[key] for key, name in METRICS.items() if key in outputs}
