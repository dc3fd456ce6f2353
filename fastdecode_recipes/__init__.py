"""Training recipes: each turns a composed job config into a trained, saved checkpoint.

A recipe is a module with ``run(job: TrainJob) -> dict`` (a summary of what it did). Register it in
``RECIPES`` and add ``configs/recipe/<name>.yaml``; see docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib
from typing import Any

RECIPES: dict[str, str] = {
    "sft": "fastdecode_recipes.sft",
    "layerskip": "fastdecode_recipes.layerskip",
    "skipdecode": "fastdecode_recipes.skipdecode",
    "cllm": "fastdecode_recipes.cllm",
    "exit_adapter": "fastdecode_recipes.exit_adapter",
}


def run(cfg: Any) -> dict:
    """Run the recipe named by ``cfg.recipe.name`` (the plain function behind ``python train.py``)."""
    from fastdecode.config import unknown_name_error
    from fastdecode_recipes.common import load_job
    from fastdecode_recipes.preflight import preflight

    job = load_job(cfg)
    name = job.recipe["name"]
    if name not in RECIPES:
        raise unknown_name_error("recipe", name, list(RECIPES), "Pick one with recipe=NAME.")
    job = preflight(job)  # data files, resume checkpoint: before any weights load
    module = importlib.import_module(RECIPES[name])
    return module.run(job, cfg)
