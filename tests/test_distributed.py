"""Two CPU processes (gloo): torchrun DDP and the DeepSpeed launcher with ZeRO-2 and ZeRO-3.

Each runs a few LayerSkip steps with layer dropout and early-exit loss on, then exports a checkpoint; the
recipe itself checks the export against the live (possibly sharded) model, and here it must reload with
``from_pretrained``. One run directory only: Hydra must not create one per rank.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import free_port, write_chat_jsonl

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.distributed


def _train(kind: str, args: list[str]) -> None:
    """``train.py args`` under the launcher of ``kind`` (2 CPU processes); its output shown if it fails."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        _launcher(kind) + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _launcher(kind: str) -> list[str]:
    port = str(free_port())
    if kind == "ddp":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    if shutil.which("deepspeed") is None:
        pytest.skip("the deepspeed launcher is not installed")
    return ["deepspeed", "--num_gpus", "2", "--master_port", port]


@pytest.mark.parametrize("kind,deepspeed", [("ddp", "none"), ("deepspeed", "zero2"), ("deepspeed", "zero3")])
def test_two_process_training_exports_a_loadable_checkpoint(tmp_path, kind, deepspeed):
    data = write_chat_jsonl(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    args = [
        "train.py",
        "recipe=layerskip",
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=4",
        "trainer.max_steps=3",
        "trainer.save_steps=3",
        "+trainer.ddp_find_unused_parameters=false",  # a layer every row drops must still get a gradient
        "recipe.layer_dropout.prob=0.5",
        "recipe.report.enabled=false",
        f"deepspeed={deepspeed}",
        f"output_dir={out}",
    ]
    _train(kind, args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "run"]  # one run directory
    summary = json.loads((out / "summary.json").read_text())
    check = summary["export_check"]  # gathered from the ranks: other layouts, within rounding
    assert check["abs_diff"] <= check["tolerance"]
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert all(p.numel() > 0 for p in model.parameters())  # no empty ZeRO-3 partitions saved
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[3, 40, 50, 60]])).logits).all()


def test_skipdecode_two_process_ddp_exports_a_loadable_checkpoint(tmp_path):
    """Every layer runs at least on the prompts, so DDP needs no unused-parameter search."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    args = [
        "train.py",
        "recipe=skipdecode",
        "recipe.max_budget=3",
        "recipe.min_budget=2",
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=4",
        "trainer.max_steps=3",
        "trainer.save_steps=3",
        "+trainer.ddp_find_unused_parameters=false",
        f"output_dir={out}",
    ]
    _train("ddp", args)
    summary = json.loads((out / "summary.json").read_text())
    check = summary["export_check"]  # gathered from the ranks: other layouts, within rounding
    assert check["abs_diff"] <= check["tolerance"]
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert all(p.numel() > 0 for p in model.parameters())


def _feature_recipe_args(data: Path, deepspeed: str, out: Path) -> list[str]:
    """A drafter trained on a tiny feature cache (8 generated answers), 2 steps, checkpointed at the end."""
    return [
        "recipe.features.max_new_tokens=6",
        "recipe.features.max_records=8",
        "recipe.features.batch_size=4",
        "recipe.features.shard_records=4",
        "recipe.report.prompts=2",
        "recipe.report.max_new_tokens=6",
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=4",
        "trainer.max_steps=2",
        "trainer.save_steps=2",
        "trainer.per_device_train_batch_size=2",
        f"deepspeed={deepspeed}",
        f"output_dir={out}",
    ]


@pytest.mark.parametrize("kind,deepspeed", [("ddp", "none"), ("deepspeed", "zero2"), ("deepspeed", "zero3")])
def test_eagle3_two_process_training_exports_the_trained_head(tmp_path, kind, deepspeed):
    """Rank 0 builds the feature cache, the other rank reuses it; the head is gathered (ZeRO-3) and saved
    once, equal to the last checkpoint's."""
    from fastdecode.drafters.eagle3.files import load_eagle3

    data = write_chat_jsonl(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    args = [
        "train.py",
        "recipe=eagle3",
        "recipe.aux_layer_ids=[1,2,3]",
        "recipe.draft_vocab_size=100",
        *_feature_recipe_args(data, deepspeed, out),
    ]
    _train(kind, args)
    summary = json.loads((out / "summary.json").read_text())
    check = summary["export_check"]  # gathered from the ranks: other layouts, within rounding
    assert check["abs_diff"] <= check["tolerance"] and summary["features"]["sequences"] == 8
    head = load_eagle3(out / "final")[0].state_dict()
    assert all(v.numel() > 0 for v in head.values())  # no empty ZeRO-3 partitions saved
    assert (out / "final" / "acceptance.json").is_file()


@pytest.mark.parametrize("kind,deepspeed", [("ddp", "none"), ("deepspeed", "zero2"), ("deepspeed", "zero3")])
def test_dflash_two_process_training_exports_the_trained_drafter(tmp_path, kind, deepspeed):
    """Rank 0 builds the feature cache, the other rank reuses it; each rank draws its own anchors; the drafter is
    gathered (ZeRO-3) and saved once, in the native format, equal to the last checkpoint's."""
    from safetensors.torch import load_file

    from dflash_train.scaling import feature_rms
    from fastdecode.drafters.dflash.files import load_dflash
    from fastdecode.files.tensor_shards import ShardReader

    data = write_chat_jsonl(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    args = [
        "train.py",
        "recipe=dflash",
        "recipe.target_layer_ids=[0,1,2]",
        "recipe.block_size=4",
        "recipe.num_anchors=4",
        "recipe.loss=both",
        *_feature_recipe_args(data, deepspeed, out),
    ]
    _train(kind, args)
    summary = json.loads((out / "summary.json").read_text())
    check = summary["export_check"]  # gathered from the ranks: other layouts, within rounding
    assert check["abs_diff"] <= check["tolerance"] and summary["features"]["sequences"] == 8
    draft = load_dflash(out / "final")[0].state_dict()
    assert all(v.numel() > 0 for v in draft.values())  # no empty ZeRO-3 partitions saved
    if (
        kind == "ddp"
    ):  # the checkpoint holds the module's state dict as is; the export folds the scale into fc
        saved = load_file(out / "checkpoint-2" / "model.safetensors")
        scale = feature_rms(ShardReader(out / "features"), [1, 2, 3])
        assert torch.allclose(draft["fc.weight"], saved["draft.fc.weight"] / scale, rtol=1e-6, atol=0)
        assert all(torch.equal(draft[k], saved[f"draft.{k}"]) for k in draft if k != "fc.weight")
    assert (out / "final" / "acceptance.json").is_file()
