"""Composed Hydra configs of the entry points on tiny models, shared by several test modules: ``eval/speed.py``,
``collect_jacobi.py`` and ``train.py recipe=layerskip``."""

from __future__ import annotations

import json
from pathlib import Path

from hydra import compose, initialize_config_dir

from fastdecode.config import CONFIG_DIR
from tests.helpers import write_chat_jsonl

SPEED_FAST = ["progress=false", "repeats=2", "warmup=1", "max_new_tokens=8"]


def write_prompts(path, n: int = 3):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Count from {i} to {i + 5}.", "response": "ok"}) + "\n")
    return path


def speed_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="speed", overrides=list(overrides))


def tiny_speed_cfg(tmp_path, *extra: str):
    data = write_prompts(tmp_path / "prompts.jsonl")
    base = [
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        f"output_dir={tmp_path / 'out'}",
        *SPEED_FAST,
    ]
    return speed_cfg(*base, *extra)


LIVELY = "+model.random_init.initializer_range=0.2"  # the default init (0.02) just repeats one token


def collect_overrides(tmp_path: Path, *extra: str, lively: bool = True) -> list[str]:
    data = tmp_path / "chat.jsonl"
    if not data.exists():
        write_chat_jsonl(data, n=14)
    return [
        "model=tiny-llama",
        *([LIVELY] if lively else []),
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=2",
        "block_size=6",
        "max_new_seq_len=20",
        "batch_size=3",
        "shard_records=10",
        "progress=false",
        f"output_dir={tmp_path / 'out'}",
        *extra,
    ]


def collect_cfg(tmp_path: Path, *extra: str, lively: bool = True):
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("collect_jacobi", overrides=collect_overrides(tmp_path, *extra, lively=lively))


def train_cfg(tmp_path: Path, recipe: str, *extra: str, rows: int = 32):
    """``train.py recipe=<recipe>`` on tiny-llama and a chat jsonl of ``rows`` conversations (written once per
    ``tmp_path``): 4 steps, a checkpoint every 2, the run in ``tmp_path / "run"``; ``extra`` comes last (wins)."""
    data = tmp_path / "chat.jsonl"
    if not data.exists():
        tmp_path.mkdir(parents=True, exist_ok=True)
        write_chat_jsonl(data, rows)
    overrides = [
        f"recipe={recipe}",
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=4",
        "trainer.max_steps=4",
        "trainer.save_steps=2",
        "trainer.logging_steps=1",
        "trainer.warmup_steps=0",
        f"output_dir={tmp_path / 'run'}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def layerskip_cfg(tmp_path: Path, *extra: str):
    return train_cfg(
        tmp_path,
        "layerskip",
        "recipe.report.prompts=2",
        "recipe.report.max_new_tokens=6",
        "recipe.layer_dropout.prob=0.5",  # high, so tiny batches really drop rows
        *extra,
    )
