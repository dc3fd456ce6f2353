"""``recipe=sft``: plain causal-LM fine-tuning on assistant tokens (the baseline the other recipes beat).

The default ``Recipe`` of ``recipes.finetune``: the HF model (with ``peft=lora``, its LoRA
weights) computes the loss from ``labels``; the Trainer passes ``num_items_in_batch`` so the loss is
normalised over the whole accumulated batch. Export (LoRA merged) verified against the live model,
``summary.json``.
"""

from __future__ import annotations

from typing import Any

from recipes.common import TrainJob
from recipes.finetune import Recipe, finetune


class SFT(Recipe):
    """Plain fine-tuning; the tokenizer goes into every Trainer checkpoint too."""

    def trainer_kwargs(self, tokenizer: Any) -> dict[str, Any]:
        return {"processing_class": tokenizer}


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Fine-tune ``job.model`` on ``job.data``; returns the checkpoint path, metrics and the export check."""
    return finetune(job, cfg, SFT(job)).summary
