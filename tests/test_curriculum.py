"""Early-exit curricula: ``rotational`` is torchtune's, ``strided`` is ours, no shipped config starves the exits.

torchtune (``torchtune/modules/early_exit_loss.py``, ``RotationalEarlyExitCurriculum``, and the recipe
``recipes/dev/early_exit_finetune_distributed.py``): the boolean mask ``slice_str_to_array(layers, L)`` is
the curriculum's state; ``get()`` returns a copy with the last layer forced on (``include_last_layer``,
default true); ``step()``, called once after every optimiser step, does ``np.roll(mask, 1)``. So at
optimiser step ``s`` (0 before the first ``step()`` call) the active exits are the initial mask rolled by
``s``, plus the last layer. The expectations below are written out by hand from that rule, not computed by
our code; ``test_literals_match_a_replica_of_torchtune`` re-derives them with a stateful numpy replica.
"""

from __future__ import annotations

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from fastdecode.config import CONFIG_DIR, ConfigError, ModelConfig, group_choices, to_dataclass
from layerskip_train.config import EarlyExitLossConfig, LayerSkipConfig
from layerskip_train.early_exit_loss import active_exits
from layerskip_train.layer_dropout import parse_layers
from recipes.common import load_job

STEPS = 12

# torchtune's active exits at optimiser steps 0..11 (one string of 0-based layer indices per step).
TORCHTUNE_ROTATIONAL = {
    (8, ":"): [
        "0 1 2 3 4 5 6 7",
        "0 1 2 3 4 5 6 7",
        "0 1 2 3 4 5 6 7",
        "0 1 2 3 4 5 6 7",
        "0 1 2 3 4 5 6 7",
        "0 1 2 3 4 5 6 7",
        "0 1 2 3 4 5 6 7",
        "0 1 2 3 4 5 6 7",
        "0 1 2 3 4 5 6 7",
        "0 1 2 3 4 5 6 7",
        "0 1 2 3 4 5 6 7",
        "0 1 2 3 4 5 6 7",
    ],
    (8, "0::4"): [
        "0 4 7",
        "1 5 7",
        "2 6 7",
        "3 7",
        "0 4 7",
        "1 5 7",
        "2 6 7",
        "3 7",
        "0 4 7",
        "1 5 7",
        "2 6 7",
        "3 7",
    ],
    (8, "1,3,5"): [
        "1 3 5 7",
        "2 4 6 7",
        "3 5 7",
        "0 4 6 7",
        "1 5 7",
        "0 2 6 7",
        "1 3 7",
        "0 2 4 7",
        "1 3 5 7",
        "2 4 6 7",
        "3 5 7",
        "0 4 6 7",
    ],
    (30, ":"): [
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
    ],
    (30, "0::4"): [
        "0 4 8 12 16 20 24 28 29",
        "1 5 9 13 17 21 25 29",
        "0 2 6 10 14 18 22 26 29",
        "1 3 7 11 15 19 23 27 29",
        "2 4 8 12 16 20 24 28 29",
        "3 5 9 13 17 21 25 29",
        "0 4 6 10 14 18 22 26 29",
        "1 5 7 11 15 19 23 27 29",
        "2 6 8 12 16 20 24 28 29",
        "3 7 9 13 17 21 25 29",
        "0 4 8 10 14 18 22 26 29",
        "1 5 9 11 15 19 23 27 29",
    ],
    (30, "1,3,5"): [
        "1 3 5 29",
        "2 4 6 29",
        "3 5 7 29",
        "4 6 8 29",
        "5 7 9 29",
        "6 8 10 29",
        "7 9 11 29",
        "8 10 12 29",
        "9 11 13 29",
        "10 12 14 29",
        "11 13 15 29",
        "12 14 16 29",
    ],
    (32, ":"): [
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
    ],
    (32, "0::4"): [
        "0 4 8 12 16 20 24 28 31",
        "1 5 9 13 17 21 25 29 31",
        "2 6 10 14 18 22 26 30 31",
        "3 7 11 15 19 23 27 31",
        "0 4 8 12 16 20 24 28 31",
        "1 5 9 13 17 21 25 29 31",
        "2 6 10 14 18 22 26 30 31",
        "3 7 11 15 19 23 27 31",
        "0 4 8 12 16 20 24 28 31",
        "1 5 9 13 17 21 25 29 31",
        "2 6 10 14 18 22 26 30 31",
        "3 7 11 15 19 23 27 31",
    ],
    (32, "1,3,5"): [
        "1 3 5 31",
        "2 4 6 31",
        "3 5 7 31",
        "4 6 8 31",
        "5 7 9 31",
        "6 8 10 31",
        "7 9 11 31",
        "8 10 12 31",
        "9 11 13 31",
        "10 12 14 31",
        "11 13 15 31",
        "12 14 16 31",
    ],
}


def _sets(rows: list[str]) -> list[list[int]]:
    return [[int(x) for x in row.split()] for row in rows]


@pytest.mark.parametrize("num_layers, layers", sorted(TORCHTUNE_ROTATIONAL), ids=str)
def test_rotational_is_torchtunes_rolled_mask(num_layers, layers):
    candidates = parse_layers(layers, num_layers)
    got = [active_exits("rotational", candidates, num_layers, step) for step in range(STEPS)]
    assert got == _sets(TORCHTUNE_ROTATIONAL[num_layers, layers])
    # torchtune's own spelling of the curriculum (EarlyExitCurriculumType.ROTATIONAL = "rot") is the same
    assert [active_exits("rot", candidates, num_layers, step) for step in range(STEPS)] == got


@pytest.mark.parametrize("num_layers, layers", sorted(TORCHTUNE_ROTATIONAL), ids=str)
def test_literals_match_a_replica_of_torchtune(num_layers, layers):
    """A stateful numpy replica of torchtune's class and recipe loop: a check on the literals above."""
    mask = np.zeros(num_layers, dtype=bool)  # torchtune's slice_str_to_array
    if "," in layers:
        mask[[int(i) for i in layers.split(",")]] = True
    else:
        start, stop, step = ([int(p) if p else None for p in layers.split(":")] + [None])[:3]
        mask[slice(start, stop, step)] = True
    state, seen = mask.copy(), []
    for _ in range(STEPS):
        current = state.copy()  # get(): a copy, the last layer forced on; the forced bit never rolls
        current[-1] = True
        seen.append(" ".join(str(i) for i in np.flatnonzero(current)))
        state = np.roll(state, 1)  # step(), after the optimiser step
    assert seen == TORCHTUNE_ROTATIONAL[num_layers, layers]


def test_torchtune_layer_specs_parse_as_there():
    """``slice_str_to_array`` semantics: "0::4" is range(0, L, 4), "1,3,5" the listed layers, ":" all."""
    assert parse_layers("0::4", 8) == [0, 4]
    assert parse_layers("0::4", 30) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert parse_layers("0::4", 32) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert parse_layers("1,3,5", 30) == [1, 3, 5]
    assert parse_layers(":", 8) == [0, 1, 2, 3, 4, 5, 6, 7]


def test_rotational_rolls_a_candidate_last_layer_onto_layer_0():
    """The mask's own last-layer bit rolls like any other; the forced last layer stays on as well."""
    assert [active_exits("rotational", [3, 7], 8, s) for s in range(3)] == [[3, 7], [0, 4, 7], [1, 5, 7]]


def test_the_recipe_trains_torchtunes_masks_through_the_config():
    cfg = to_dataclass(
        LayerSkipConfig, {"early_exit_loss": {"layers": "0::4", "curriculum": "rotational"}}, "recipe"
    )
    ee = cfg.early_exit_loss
    got = [
        active_exits(ee.curriculum, parse_layers(ee.layers, 8), 8, s, 100, stride=ee.stride)
        for s in range(STEPS)
    ]
    assert got == _sets(TORCHTUNE_ROTATIONAL[8, "0::4"])


# --------------------------------------------------------------------------------------------------------
# The old stride key is refused, naming the fix
def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=["model=tiny-llama", *overrides])


def _recipe(*overrides: str) -> LayerSkipConfig:
    return to_dataclass(LayerSkipConfig, load_job(_compose(*overrides)).recipe, "recipe")


def test_rotation_is_not_a_key():
    """``stride`` is the strided curriculum's R; no other name reads it."""
    with pytest.raises(ConfigError, match=r"Unknown key 'recipe\.early_exit_loss\.rotation'.*stride"):
        to_dataclass(EarlyExitLossConfig, {"curriculum": "strided", "rotation": 2}, "recipe.early_exit_loss")


def test_strided_is_the_default():
    ee = _recipe().early_exit_loss
    assert (ee.curriculum, ee.stride, ee.layers) == ("strided", 4, ":")
    assert EarlyExitLossConfig().curriculum == "strided" and EarlyExitLossConfig().stride == 4
    with pytest.raises(ConfigError, match="stride must be >= 1"):
        _recipe("recipe.early_exit_loss.stride=0")


# --------------------------------------------------------------------------------------------------------
# No shipped config trains a step without an early exit, unless it asks for that
DEPTHS = {"smollm2-135m": 30}  # blocks of the shipped models whose weights are not built from random_init


def _depth(model: ModelConfig) -> int:
    if model.random_init:
        return model.random_init["num_hidden_layers"]
    assert model.name in DEPTHS, f"add the depth of model {model.name} to DEPTHS"
    return DEPTHS[model.name]


def _asks_for_last_exit_only(ee: EarlyExitLossConfig, num_layers: int) -> bool:
    """A config asks for steps with the last exit alone only if ``layers`` selects no other layer, or if its
    curriculum is ``gradual``, whose documented schedule starts with the last exit alone."""
    return set(parse_layers(ee.layers, num_layers)) <= {num_layers - 1} or ee.curriculum == "gradual"


def _shipped_layerskip_configs() -> list[tuple[str, list[str]]]:
    configs = [("default", [])]
    for name in group_choices("experiment"):
        configs.append((name, [f"experiment={name}"]))
    return configs


@pytest.mark.parametrize("name, overrides", _shipped_layerskip_configs(), ids=lambda x: str(x))
def test_no_shipped_config_leaves_a_step_without_an_early_exit(name, overrides, tmp_path):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        job = load_job(compose(config_name="train", overrides=[*overrides, f"output_dir={tmp_path}"]))
    if job.recipe["name"] != "layerskip":
        pytest.skip(f"{name} is a {job.recipe['name']} config")
    ee = to_dataclass(LayerSkipConfig, job.recipe, "recipe").early_exit_loss
    num_layers = _depth(job.model)
    assert not _asks_for_last_exit_only(ee, num_layers)  # none of them asks: the check below applies to all
    candidates = parse_layers(ee.layers, num_layers)
    total = job.trainer.get("max_steps", 2 * num_layers)
    starved = [
        step
        for step in range(2 * num_layers)
        if active_exits(ee.curriculum, candidates, num_layers, step, total, stride=ee.stride)
        == [num_layers - 1]
    ]
    assert starved == [], f"{name}: only the last exit trains at steps {starved}"


def test_the_starvation_check_catches_the_old_trap():
    """What issue 15 found: torchtune's ``layers: "0::4"`` read with a stride of 4 trains no early exit on
    three steps of four (on 32 layers); torchtune's rotation trains 7 or 8 early exits on every step."""
    candidates = parse_layers("0::4", 32)
    strided = [active_exits("strided", candidates, 32, s, stride=4) for s in range(4)]
    assert strided == [[0, 4, 8, 12, 16, 20, 24, 28, 31], [31], [31], [31]]
    early = [len(active_exits("rotational", candidates, 32, s)) - 1 for s in range(64)]
    assert early == [8, 8, 8, 7] * 16  # at step 4k+3 the rolled mask reaches the last layer itself
