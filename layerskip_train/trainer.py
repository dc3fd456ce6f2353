"""``LayerSkipTrainer``: the HF Trainer with the LayerSkip loss. Overrides ``compute_loss`` only (passes the
step); the per-exit losses reach the logs through ``fastdecode.training.trainer_logs``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import Trainer

from fastdecode.training.trainer_logs import ComponentLogsMixin


class LayerSkipTrainer(ComponentLogsMixin, Trainer):
    """Trains an ``EarlyExitLM``; logs per-exit cross-entropy as ``loss/exit_<E>`` (E = blocks run) and the
    self-distillation KL as ``kl/exit_<E>`` (``eval_loss/exit_<L>`` in evaluation: the final exit only).

    The optimiser step (``state.global_step``) and the micro-step within it are passed to the model, so the
    curriculum and the layer-dropout draws are pure functions of the step: a resumed run repeats them.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._micro = (-1, 0)  # (global step, micro-step within it)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        step = self.state.global_step
        micro = self._micro[1] + 1 if self._micro[0] == step and model.training else 0
        self._micro = (step, micro)
        inputs = {**inputs, "step": step, "micro_step": micro}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def loss_components(self, outputs: Mapping[str, Any]) -> dict[str, Any]:
        ce = {f"loss/exit_{layer + 1}": value for layer, value in outputs["exit_ce"].items()}
        return ce | {f"kl/exit_{layer + 1}": value for layer, value in outputs["exit_kl"].items()}
