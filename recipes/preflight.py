"""Everything about a training job that can be checked from configs and files, checked before any weights load.

``recipes.run`` calls :func:`preflight` right after the config is typed (``load_job``): the data
files, the evaluation-only guard and the checkpoint to resume from. A recipe then checks its own settings
against the model's ``config.json`` (``fastdecode.runtime.loading.model_config``), still before the weights.
"""

from __future__ import annotations

import dataclasses
import logging

from fastdecode.data.config import check_data_files, check_trainable
from fastdecode.files.io import check_writable
from recipes.common import TrainJob
from recipes.resume import finished_at, resolve_resume

log = logging.getLogger(__name__)


def preflight(job: TrainJob) -> TrainJob:
    """Check ``job`` without loading anything big; return it with ``resume_from_checkpoint`` resolved to
    a complete checkpoint's path (or None), so the recipe's resume is decided here, once.
    """
    check_data_files(job.data)
    check_writable(job.output_dir)  # checkpoints, final/, summary.json: refused now, not after training
    if job.recipe.get("name") != "cllm":  # CLLM trains on trajectories; its data group only feeds a report
        check_trainable(job.data)
    resume = resolve_resume(job.resume_from_checkpoint, job.output_dir)
    step = finished_at(resume, job.trainer.get("max_steps", -1))
    if step is not None:
        log.info(
            "resume: %s already reached max_steps=%s: the run is trained; only what follows training "
            "(evaluation, export, reports) is done again",
            resume,
            job.trainer.get("max_steps"),
        )
    return dataclasses.replace(job, resume_from_checkpoint=resume)
