"""``train.run(cfg)`` end to end on a tiny model and a local jsonl: trains, saves, reloads; config saved."""

from __future__ import annotations

import json

import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

import recipes
from fastdecode.config import CONFIG_DIR


def _write_jsonl(path, n=24):
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps({"prompt": f"Count to {i % 7} (take {i}).", "response": " ".join(map(str, range(i % 7)))})
                + "\n"
            )


def test_sft_recipe_trains_saves_and_reloads(tmp_path):
    data = tmp_path / "chat.jsonl"
    _write_jsonl(data)
    out = tmp_path / "run"
    overrides = [
        "recipe=sft",
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=4",
        "trainer.max_steps=3",
        "trainer.save_steps=2",
        "trainer.logging_steps=1",
        f"output_dir={out}",
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    summary = recipes.run(cfg)
    assert (out / "config.yaml").is_file()  # the resolved config sits next to the outputs
    assert "tiny-llama" in (out / "config.yaml").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    assert torch.isfinite(torch.tensor(summary["metrics"]["eval_loss"]))
    assert sum(p.numel() for p in reloaded.parameters()) > 0
    assert (out / "checkpoint-2").is_dir()
