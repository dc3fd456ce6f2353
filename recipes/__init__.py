"""The recipe sequence every training method shares, and the registry of recipes.

A recipe is a module with ``run(job: TrainJob, cfg) -> dict`` (a summary of what it did): ``sft`` here, every
other one the ``recipe`` module of its method package (``layerskip_train/recipe.py``, ...), which imports
this package, never the other way round. ``RECIPES`` names each recipe's module as a dotted string, imported
by name only when a run asks for that recipe: the one way up from here, and the only place in this package
that names a method package (``tests/test_architecture.py``). A new recipe: its module, one line here and
``configs/recipe/<name>.yaml``; see docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib
from typing import Any

# recipe name (``recipe=NAME``) -> the dotted name of the module with its ``run``
RECIPES: dict[str, str] = {
    "sft": "recipes.sft",
    "layerskip": "layerskip_train.recipe",
    "skipdecode": "skipdecode_train.recipe",
    "cllm": "cllm_train.recipe",
    "exit_adapter": "adapter_train.recipe",
    "eagle3": "eagle3_train.recipe",
    "dflash": "dflash_train.recipe",
}


def run(cfg: Any) -> dict:
    """Run the recipe named by ``cfg.recipe.name`` (the plain function behind ``python train.py``)."""
    from fastdecode.config import unknown_name_error
    from recipes.common import load_job
    from recipes.preflight import preflight

    job = load_job(cfg)
    name = job.recipe["name"]
    if name not in RECIPES:
        raise unknown_name_error("recipe", name, list(RECIPES), "Pick one with recipe=NAME.")
    job = preflight(job)  # data files, resume checkpoint: before any weights load
    module = importlib.import_module(RECIPES[name])
    return module.run(job, cfg)
