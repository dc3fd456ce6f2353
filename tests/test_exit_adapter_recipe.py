"""``recipe=exit_adapter`` end to end on tiny-llama: features cached once, adapters saved beside the untouched
base model, the chosen exit, lossless decoding through the saved run, bad input before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recipes
from fastdecode.config import ConfigError
from fastdecode.decoding.config import DecodeConfig
from fastdecode.drafters.exits.adapter import DraftVocabMismatchError, ExitLayerError, read_meta
from fastdecode.registry import DECODERS
from fastdecode.runtime.identity import weights_fingerprint
from fastdecode.runtime.model import EarlyExitModel
from tests.helpers import tiny_model
from tests.job_configs import train_cfg


def adapter_cfg(tmp_path: Path, *extra: str):
    return train_cfg(
        tmp_path,
        "exit_adapter",
        "trainer.learning_rate=1e-3",
        "recipe.exits=[1,2]",
        "recipe.draft_vocab_size=16",
        "recipe.report.prompts=2",
        "recipe.report.max_new_tokens=6",
        "recipe.report.speed_prompts=1",
        "recipe.report.speed_new_tokens=6",
        "recipe.features.batch_size=4",
        "recipe.features.shard_records=8",
        *extra,
    )


def test_exit_adapter_recipe_end_to_end(tmp_path):
    summary = recipes.run(adapter_cfg(tmp_path))
    final = Path(summary["final"])
    index = json.loads((final / "adapters.json").read_text())
    assert set(index["adapters"]) == {"1", "2"} and set(index["agreement"]["adapter"]) == {"1", "2"}
    for exit_layer in (1, 2):
        meta = read_meta(final / f"E{exit_layer}")
        assert meta["exit_layer"] == exit_layer and meta["draft_vocab"]["size"] <= 16
        assert meta["base"]["tokenizer"]["vocab_hash"] and meta["training"]["epochs"] > 0
    # The base model: bitwise what a fresh load gives, and the same perplexity before and after.
    assert summary["base_weights_unchanged"]
    assert summary["base_weights_sha256"] == weights_fingerprint(tiny_model("tiny-llama")[0], full=True)
    assert summary["perplexity"] == summary["perplexity_before"]
    assert summary["features"]["scored_positions"] > 0 and summary["features"]["positions_per_s"] > 0
    assert summary["training"]["scored_positions_per_s"] > 0
    assert {"kl/E1", "agree/E2"} <= set(summary["training"]["history"][0])
    speed = summary["speed"]  # the plan's decoders, lossless: the same tokens as autoregressive decoding
    assert all(r["tokens"] == speed["autoregressive"]["tokens"] for r in speed["decoders"].values())
    drafters = [c["options"].get("adapter") for c in speed["plan"]["candidates"]]
    assert drafters[-1] is None and all(
        n["drafter"] == "adapter" for n in speed["plan"]["not_paying"]
    )  # prompt lookup last; the adapter chained first where it pays, named where it does not
    # Decoding through the run directory (the chosen exit, or one named) is lossless.
    m = EarlyExitModel(tiny_model("tiny-llama")[0])
    prompts = [[3, 50, 60, 70], [3, 80]]
    ref = DECODERS["autoregressive"](m, prompts, DecodeConfig(max_new_tokens=10)).tokens
    for path in (final / "E1", final / "E2"):
        out = DECODERS["self_speculative"](m, prompts, DecodeConfig(max_new_tokens=10, adapter=str(path)))
        assert out.tokens == ref
    # A second run reuses the feature cache (same model, data and settings): nothing recomputed.
    manifest = json.loads((tmp_path / "run" / "features" / "manifest.json").read_text())
    again = recipes.run(adapter_cfg(tmp_path, "recipe.exits=[2]", "recipe.kind=attention"))
    assert json.loads((tmp_path / "run" / "features" / "manifest.json").read_text()) == manifest
    assert again["features"]["scored_positions"] == summary["features"]["scored_positions"]


def test_the_model_generates_its_own_training_data(tmp_path):
    summary = recipes.run(
        adapter_cfg(
            tmp_path,
            "recipe.features.source=generate",
            "recipe.features.max_new_tokens=5",
            "recipe.features.max_records=8",
            "recipe.loss.target=full",
            "recipe.loss.ce_weight=0.5",
            "recipe.report.enabled=false",
        )
    )
    assert summary["features"]["sequences"] == 8 and summary["features"]["scored_positions"] <= 40
    assert summary["chosen"] is None


def test_bad_exits_and_draft_vocabularies_fail_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr("adapter_train.recipe.build_datasets", lambda *a, **k: pytest.fail("data was read"))
    with pytest.raises(ExitLayerError, match=r"recipe.exits=4 .*\[1, 3\]"):
        recipes.run(adapter_cfg(tmp_path, "recipe.exits=[2,4]"))
    with pytest.raises(ExitLayerError, match=r"recipe.exits=0"):
        recipes.run(adapter_cfg(tmp_path, "recipe.exits=[0]"))
    bad = tmp_path / "vocab.json"
    bad.write_text(json.dumps({"vocab_size": 32000, "size": 2, "ids": [1, 2]}))
    with pytest.raises(DraftVocabMismatchError, match="32000 ids but this tokenizer has 261"):
        recipes.run(adapter_cfg(tmp_path, f"recipe.draft_vocab={bad}"))


def test_a_run_resumes_from_its_checkpoint_and_exports_only_the_adapters(tmp_path):
    fast = ("recipe.report.enabled=false", "resume_from_checkpoint=auto")
    first = recipes.run(adapter_cfg(tmp_path, "trainer.max_steps=2", *fast))
    run = tmp_path / "run"
    assert (run / "checkpoint-2").is_dir() and first["training"]["metrics"]["train_steps_per_second"] > 0
    resumed = recipes.run(adapter_cfg(tmp_path, *fast))  # max_steps=4: steps 3 and 4 only
    steps = [h["step"] for h in resumed["training"]["history"]]
    assert steps == [1, 2, 3, 4] and (run / "checkpoint-4").is_dir()
    assert resumed["export_check"]["abs_diff"] == 0  # the saved adapters, loaded back, are the trained ones
    # A finished run resumed: nothing is trained again; the export and the summary are redone.
    again = recipes.run(adapter_cfg(tmp_path, *fast))
    assert (
        again["metrics"]["train_steps_this_run"] == 0 and again["training"]["scored_positions_per_s"] is None
    )
    for e in ("E1", "E2"):
        assert read_meta(run / "final" / e)["exit_layer"] == int(e[1:])
    # final/ holds the adapters and the run's description, never base weights
    names = {p.name for p in (run / "final").iterdir()}
    assert names == {"E1", "E2", "adapters.json", "fastdecode.json", ".fastdecode-complete.json"}
    assert json.loads((run / "final" / "fastdecode.json").read_text())["recipe"] == "exit_adapter"


def test_lora_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr("recipes.finetune.load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match="set peft=none"):
        recipes.run(adapter_cfg(tmp_path, "peft=lora"))
