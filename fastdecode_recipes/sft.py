"""``recipe=sft``: plain causal-LM fine-tuning on assistant tokens (the baseline the other recipes beat).

model -> data -> Trainer -> train -> save. The HF model computes the loss from ``labels``; the Trainer passes
``num_items_in_batch`` so the loss is normalised over the whole accumulated batch.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from fastdecode.data.chat import build_datasets, collate
from fastdecode.distributed import is_main_process
from fastdecode.io import atomic_directory, save_resolved_config
from fastdecode.loading import load_model
from fastdecode_recipes.common import TrainJob, export_checkpoint, resolve_resume, training_arguments
from fastdecode_recipes.resume import train as train_or_finish

log = logging.getLogger(__name__)


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Fine-tune ``job.model`` on ``job.data``; returns the final metrics and the checkpoint path."""
    from transformers import Trainer, set_seed

    set_seed(job.seed)
    model, tokenizer = load_model(job.model)
    train, held_out = build_datasets(job.data, tokenizer)
    args = training_arguments(job)
    if cfg is not None:
        save_resolved_config(cfg, job.output_dir)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=held_out or None,
        data_collator=functools.partial(collate, pad_id=tokenizer.pad_token_id, mask_dtype=model.dtype),
        processing_class=tokenizer,
    )
    result = train_or_finish(trainer, resolve_resume(job))
    final = Path(job.output_dir) / "final"
    with atomic_directory(final, main_process=is_main_process(), fault="export") as stage:  # all or nothing
        export_checkpoint(trainer, model, tokenizer, job.peft, stage)
    metrics = dict(result.metrics)
    if held_out:
        metrics |= trainer.evaluate()
    log.info("sft done: %s", metrics)
    return {"checkpoint": str(final), "metrics": metrics}
