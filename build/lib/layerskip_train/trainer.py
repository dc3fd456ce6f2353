"""``LayerSkipTrainer``: the HF Trainer with the LayerSkip loss. Overrides ``compute_loss`` and ``log`` only."""

from __future__ import annotations

from collections import defaultdict

from transformers import Trainer


class LayerSkipTrainer(Trainer):
    """Trains an ``EarlyExitLM``; logs per-exit cross-entropy as ``loss/exit_<E>`` (E = blocks run).

    The optimiser step (``state.global_step``) and the micro-step within it are passed to the model, so the
    curriculum and the layer-dropout draws are pure functions of the step: a resumed run repeats them.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._exit_sums: dict[str, float] = defaultdict(float)
        self._exit_counts: dict[str, int] = defaultdict(int)
        self._micro = (-1, 0)  # (global step, micro-step within it)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        step = self.state.global_step
        micro = self._micro[1] + 1 if self._micro[0] == step and model.training else 0
        self._micro = (step, micro)
        inputs = {**inputs, "step": step, "micro_step": micro}
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        if model.training:
            for kind in ("exit_ce", "exit_kl"):
                for layer, value in outputs[kind].items():
                    key = f"{'loss' if kind == 'exit_ce' else 'kl'}/exit_{layer + 1}"
                    self._exit_sums[key] += float(value)
                    self._exit_counts[key] += 1
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._exit_counts:  # a training log: add the per-exit means since the last one
            for key, total in self._exit_sums.items():
                logs[key] = round(total / self._exit_counts[key], 4)
            self._exit_sums.clear()
            self._exit_counts.clear()
        super().log(logs, start_time)
