"""``recipe=dflash`` end to end on tiny-llama: the drafter exported in the native format and equal to the trained
one, its acceptance record per block slot, the corpus beside it, resume, gradient accumulation, bad settings
refused before the weights load, the tied-head check, a cache built by ``recipe=eagle3`` reused as it is;
the loss overfits a tiny batch; the report's drafts equal a block drafted by hand from its anchor's context."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

import recipes
from dflash_train.config import DFlashRecipeConfig
from dflash_train.module import DFlashLM, TargetHeadError, collate_records
from dflash_train.report import block_drafts
from dflash_train.scaling import feature_rms, fold_feature_scale
from fastdecode.config import CONFIG_DIR, ConfigError, to_dataclass
from fastdecode.drafters.dflash.files import load_dflash
from fastdecode.drafters.dflash.layer import DFlashDraft
from fastdecode.drafters.dflash.model import DFlashConfig
from fastdecode.files.tensor_shards import ShardReader
from fastdecode.plan.acceptance import read_record
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training.drafter_report import leading_matches
from tests.helpers import lively_model, tiny_model
from tests.job_configs import LIVELY, train_cfg

LAYERS = [0, 1, 2]  # decoder layers of tiny-llama (4 layers): cache exits [1, 2, 3]
FEATURES = (
    "recipe.features.batch_size=4",
    "recipe.features.shard_records=8",
    "recipe.features.max_new_tokens=8",
    "recipe.features.max_records=16",
)


def dflash_cfg(tmp_path: Path, *extra: str):
    return train_cfg(
        tmp_path,
        "dflash",
        LIVELY,
        "trainer.learning_rate=3e-3",
        "recipe.target_layer_ids=[0,1,2]",
        "recipe.block_size=4",
        "recipe.gamma=4",
        "recipe.num_anchors=6",
        "recipe.report.prompts=3",
        "recipe.report.max_new_tokens=8",
        *FEATURES,
        *extra,
    )


def test_dflash_recipe_trains_exports_and_records(tmp_path):
    summary = recipes.run(dflash_cfg(tmp_path, "recipe.loss=both"))
    run, final = tmp_path / "run", tmp_path / "run" / "final"
    trained = {
        k.removeprefix("draft."): v for k, v in load_file(run / "checkpoint-4" / "model.safetensors").items()
    }
    draft, cfg = load_dflash(final)
    saved = draft.state_dict()
    # trained on the features over their channel RMS: the export reads raw features, fc's columns divided
    scale = feature_rms(ShardReader(run / "features"), [1, 2, 3])
    assert not torch.equal(scale, torch.ones_like(scale))
    assert torch.allclose(saved["fc.weight"], trained["fc.weight"] / scale, rtol=1e-6, atol=0)
    assert set(saved) == set(trained) and all(
        torch.equal(saved[k], trained[k]) for k in saved if k != "fc.weight"
    )
    config = json.loads((final / "config.json").read_text())
    assert config["fastdecode"]["speculative_tokens"] == 3
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == LAYERS and cfg.feature_ids == [1, 2, 3]
    assert config["dflash_config"]["mask_token_id"] == summary["mask_token_id"] == cfg.mask_token_id
    assert "embed_tokens.weight" not in load_file(final / "model.safetensors")  # the target's: not saved
    check = summary["export_check"]  # the folded scale: the same function up to rounding
    assert check["abs_diff"] <= check["tolerance"] and summary["base_weights_unchanged"]
    # acceptance.json: per block slot, what auto plans from, consistent with the summary's figures
    (drafter,) = read_record(final).find("dflash")
    figures = summary["acceptance"]
    assert len(figures["conditional_acceptance"]) == 3
    assert drafter.acceptance == figures["conditional_acceptance"][0]
    assert sorted(drafter.tokens_per_round) == [1, 2, 3] and set(figures["acceptance_length"]) == {3}
    assert all(1.0 <= v <= k + 1 for k, v in drafter.tokens_per_round.items())
    assert figures["answers"] == 3 and figures["tokens"] > 0
    logged = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())["log_history"][0]
    assert {"acc_1", "acc_3", "accept_len"} <= set(logged)
    assert summary["features"]["sequences"] == 16 and summary["corpus"]["sequences"] == 16
    assert (final / "corpus.sfx").is_file() and summary["speculative_tokens"] == 3


def test_a_cache_built_by_recipe_eagle3_is_reused_as_it_is(tmp_path, monkeypatch):
    """One generation serves both drafters: the same features block and a superset of exits."""
    shared = ("recipe.features.dir=" + str(tmp_path / "features"), "recipe.features.exits=[1,2,3]")
    eagle = train_cfg(
        tmp_path,
        "eagle3",
        LIVELY,
        "recipe.aux_layer_ids=[1,2,3]",
        "recipe.draft_vocab_size=200",
        "recipe.report.enabled=false",
        "trainer.max_steps=1",
        *FEATURES,
        *shared,
        f"output_dir={tmp_path / 'eagle3'}",
    )
    recipes.run(eagle)
    monkeypatch.setattr(
        "fastdecode.training.features._feature_records", lambda *a, **k: pytest.fail("features recomputed")
    )
    once = ("recipe.report.enabled=false", "trainer.max_steps=1", f"output_dir={tmp_path / 'dflash'}")
    summary = recipes.run(dflash_cfg(tmp_path, *once, *shared))
    check = summary["export_check"]
    assert (
        summary["features"]["dir"] == str(tmp_path / "features") and check["abs_diff"] <= check["tolerance"]
    )


def test_the_experiment_shares_the_eagle3_experiments_cache():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        found = {
            name: compose(config_name="train", overrides=[f"experiment=smollm2-{name}-cpu"])
            for name in ("eagle3", "dflash")
        }
    assert found["dflash"].recipe.features == found["eagle3"].recipe.features
    assert found["dflash"].data == found["eagle3"].data and found["dflash"].model == found["eagle3"].model
    rcfg = to_dataclass(DFlashRecipeConfig, found["dflash"].recipe, "recipe")
    assert rcfg.feature_ids(30) == [2, 9, 15, 21, 28] and rcfg.cached_exits(30) == [2, 9, 15, 21, 27, 28]


def test_gradient_accumulation_trains_like_one_large_batch(tmp_path):
    """4 answers in 1 micro-batch == 2 x 2: each row's anchors are drawn from (seed, step, rank, row) and every
    micro-batch's loss is divided by the slot weight of the whole step."""
    runs = {}
    for batch, accum in ((4, 1), (2, 2)):
        out = tmp_path / f"b{batch}"
        extra = (
            f"trainer.per_device_train_batch_size={batch}",
            f"trainer.gradient_accumulation_steps={accum}",
            "trainer.max_steps=2",
            "trainer.save_steps=2",
            "recipe.report.enabled=false",
        )
        recipes.run(dflash_cfg(out, *extra))
        state = json.loads((out / "run" / "checkpoint-2" / "trainer_state.json").read_text())
        runs[batch] = [v for h in state["log_history"] if "loss" in h for v in (h["loss"], h["grad_norm"])]
    assert len(runs[4]) == 4 and runs[4] == pytest.approx(runs[2], rel=1e-4)


def test_a_run_resumes_from_its_checkpoint(tmp_path):
    # raw features: the export is the trained drafter to the bit, so the check is exact
    fast = ("recipe.report.enabled=false", "resume_from_checkpoint=auto", "recipe.feature_scale=none")
    recipes.run(dflash_cfg(tmp_path, "trainer.max_steps=2", *fast))
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
    resumed = recipes.run(dflash_cfg(tmp_path, *fast))  # steps 3 and 4 only
    state = json.loads((tmp_path / "run" / "checkpoint-4" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4]
    assert resumed["export_check"]["abs_diff"] == 0


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["recipe.target_layer_ids=[0,1,3]"], r"recipe.target_layer_ids=\[0, 1, 3\]: .*\[0, 2\]"),
        (["recipe.target_layer_ids=[2,1]"], r"recipe.target_layer_ids=\[2, 1\]: .*strictly increasing"),
        (["recipe.block_size=1"], r"recipe.block_size=1"),
        (["recipe.speculative_tokens=4"], r"recipe.speculative_tokens=4: .* 1..3"),
        (["recipe.loss=mse"], r"Unknown recipe.loss 'mse'"),
        (["recipe.num_anchors=0"], r"recipe.num_anchors=0"),
        (["recipe.gamma=0"], r"recipe.gamma=0"),
        (["recipe.mask_token_id=261"], r"recipe.mask_token_id=261 .* \[0, 261\)"),
        (["recipe.features.exits=[4]"], r"recipe.features.exits has 4 .* \[1, 3\]"),
        (["recipe.features.mode=online"], r"recipe.features.mode=cache"),
        (["peft=lora"], "set peft=none"),
        (["recipe.report.data=nope"], "recipe.report.data"),
    ],
)
def test_bad_settings_are_refused_before_the_weights_load(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr("recipes.finetune.load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match=message):
        recipes.run(dflash_cfg(tmp_path, *overrides))


def tiny_draft(model, block: int = 4, seed: int = 0) -> DFlashDraft:
    cfg = DFlashConfig.from_target(model.config, mask_token_id=3, target_layer_ids=LAYERS, block_size=block)
    torch.manual_seed(seed)
    return DFlashDraft(cfg)


def test_a_tied_target_whose_head_is_not_its_embedding_is_refused():
    model = copy.deepcopy(tiny_model("tiny-llama")[0])
    loss = {"kind": "ce", "gamma": 4.0, "num_anchors": 4, "seed": 0}
    DFlashLM(EarlyExitModel(model), tiny_draft(model), loss)  # tied as declared: accepted
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))  # left untied
    with pytest.raises(TargetHeadError, match="tie_word_embeddings=true but its lm_head is not"):
        DFlashLM(EarlyExitModel(model), tiny_draft(model), loss)
    model.config.tie_word_embeddings = False  # a head of its own, declared so: accepted
    DFlashLM(EarlyExitModel(model), tiny_draft(model), loss)


def synthetic_record(
    prompt: int, answer: int, seed: int, with_final: bool = False
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    length = prompt + answer - 1
    tokens = torch.randint(5, 250, (prompt + answer,), generator=gen).int()  # the prompt, then the answer
    out = {
        "input_ids": tokens[:-1],
        "scored": torch.arange(prompt - 1, length).int(),
        "targets": tokens[prompt:],
        "teacher": tokens[prompt:],
    }
    out |= {f"h{e}": torch.randn(length, 64, generator=gen) for e in (1, 2, 3)}
    return out | ({"final": torch.randn(answer, 64, generator=gen)} if with_final else {})


def test_collated_labels_point_at_the_teacher_row_that_predicts_them():
    records = [synthetic_record(3, 5, 0, True), synthetic_record(2, 4, 1, True)]
    batch = collate_records(records, [1, 2, 3])
    assert batch["features"].shape == (2, 7, 192) and batch["input_ids"].shape == (2, 8)
    assert (
        batch["input_ids"][0].tolist()
        == records[0]["input_ids"].tolist() + records[0]["targets"][-1:].tolist()
    )
    assert batch["response"][0].nonzero().flatten().tolist() == [3, 4, 5, 6, 7]
    assert batch["response"][1].nonzero().flatten().tolist() == [2, 3, 4, 5]
    # the token at position 4 of row 1 is predicted from position 3: the record's 2nd scored position, row 5 + 2
    assert int(batch["label_index"][1, 4]) == 5 + 2 and torch.equal(batch["final"][7], records[1]["final"][2])


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_the_loss_goes_down_on_a_tiny_overfit_batch(kind):
    m = lively_model("tiny-llama")  # a head with larger weights: the shared model's logits are nearly flat
    model, draft = m.hf, tiny_draft(m.hf)
    lm = DFlashLM(m, draft, {"kind": kind, "gamma": 4.0, "num_anchors": 8, "seed": 0})
    batch = collate_records([synthetic_record(4, 12, 0, True), synthetic_record(3, 10, 1, True)], [1, 2, 3])
    optimizer = torch.optim.Adam(draft.parameters(), lr=1e-2)
    losses = []
    for _ in range(80):
        loss = lm(**batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    if kind == "ce":
        assert all(float(lm.last_metrics[f"acc_{k}"]) == 1.0 for k in (1, 2, 3))
    assert all(p.grad is None for p in model.parameters())  # nothing flows into the target


@torch.no_grad()
def test_the_feature_scale_is_each_channels_rms_and_folds_into_fc():
    records = [synthetic_record(3, 6, 0), synthetic_record(4, 5, 1)]
    records[0]["h2"][0, 7] = 1e4  # position 0 (the sink's outliers) is left out
    reader = type("Reader", (), {"__len__": lambda self: 2, "read": lambda self, i, f: records[i]})()
    scale = feature_rms(reader, [1, 2, 3])
    rows = torch.cat([torch.cat([r[f"h{e}"] for e in (1, 2, 3)], -1)[1:] for r in records])
    assert torch.allclose(scale, rows.pow(2).mean(0).sqrt()) and scale.shape == (192,)
    # training on features / scale == the folded drafter on the raw features
    m = EarlyExitModel(tiny_model("tiny-llama")[0])
    draft = tiny_draft(m.hf)
    loss = {"kind": "ce", "gamma": 4.0, "num_anchors": 4, "seed": 0}
    batch = collate_records([synthetic_record(4, 9, 2, True), synthetic_record(3, 8, 3, True)], [1, 2, 3])
    batch["features"][:, :, 5] *= 300.0  # one outsized channel, as SmolLM2's
    scaled = DFlashLM(m, draft, loss, feature_scale=scale)(**batch)["loss"]
    folded = copy.deepcopy(draft)
    fold_feature_scale(folded, scale)
    raw = DFlashLM(m, folded, loss)(**batch)["loss"]
    assert torch.allclose(scaled, raw, rtol=1e-5) and not torch.allclose(
        raw, DFlashLM(m, draft, loss)(**batch)["loss"]
    )
    with pytest.raises(ValueError, match="input channels"):
        fold_feature_scale(folded, scale[:10])


@torch.no_grad()
def test_the_reports_blocks_are_the_blocks_decoding_drafts():
    """All anchors of an answer in one forward under the block mask == each block drafted alone, as decoding
    does: the context is the target's features of the tokens before the anchor, the block [a_{j-1}, MASK...]
    at positions P + j - 1 ...; and the leading matches count the drafts equal to the answer."""
    model = tiny_model("tiny-llama")[0]
    m, draft = EarlyExitModel(model), tiny_draft(model, seed=3).eval()
    record = synthetic_record(5, 7, 2)
    drafts = block_drafts(draft, m, record, [1, 2, 3])
    answer = record["targets"].tolist()
    ids = record["input_ids"].tolist() + answer[-1:]
    features = torch.cat([record[f"h{e}"] for e in (1, 2, 3)], -1)[None]
    prompt, n = 5, 7
    assert drafts.shape == (n - 1, 3)
    for j in range(1, n):
        anchor = prompt + j - 1
        kv = draft.context_kv(features[:, :anchor], torch.arange(anchor)[None])
        block = torch.tensor([[ids[anchor], 3, 3, 3]])
        hidden = draft(m.token_embed(block), torch.arange(anchor, anchor + 4)[None], kv)
        assert m.head_logits(hidden[0, 1:]).argmax(-1).tolist() == drafts[j - 1].tolist()
    # leading matches: start 1 matches a_1, a_2 then misses; start 4 matches a_4, a_5, a_6 (the end)
    made = torch.tensor([[11, 12, 0], [0, 0, 0], [0, 0, 0], [14, 15, 16], [0, 0, 0], [16, 0, 0]])
    lead, hits, tried = leading_matches(made, [10, 11, 12, 13, 14, 15, 16])
    assert lead == [0, 2, 0, 0, 3, 0, 1]
    assert tried == [6, 2, 2] and hits == [3, 2, 1]
