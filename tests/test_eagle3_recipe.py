"""``recipe=eagle3`` end to end on tiny-llama (feature cache and online mode): the head exported in both
dialects and equal to the trained one, its acceptance record, resume, bad settings refused before the
weights load; and the report's chain replay against chain drafting by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import recipes
from eagle3_train.losses import ttt_loss
from eagle3_train.module import step0_items
from eagle3_train.report import chain_drafts
from fastdecode.api import FastDecoder
from fastdecode.config import ConfigError, load_group
from fastdecode.data.config import DataConfig
from fastdecode.data.sources import load_records
from fastdecode.data.splits import first_user_turn
from fastdecode.data.twins import prompt_digests
from fastdecode.decoding.autoregressive import generate as autoregressive
from fastdecode.decoding.config import DecodeConfig
from fastdecode.drafters.eagle3.files import load_eagle3
from fastdecode.drafters.eagle3.layer import Eagle3KV
from fastdecode.drafters.eagle3.model import Eagle3Config, Eagle3Head
from fastdecode.drafters.suffix.index_file import load_index
from fastdecode.files.tensor_shards import ShardReader
from fastdecode.plan.acceptance import (
    AcceptanceRecord,
    DrafterRecord,
    read_record,
    replay_leads,
    write_record,
)
from fastdecode.registry import corpus_fingerprint, corpus_prompt_keys
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.tokens import IGNORE_INDEX
from fastdecode.training.answers import ANSWERS_FILE
from fastdecode.training.drafter_report import leading_matches
from tests.helpers import tiny_model
from tests.job_configs import LIVELY, train_cfg

AUX = [1, 2, 3]


def eagle3_cfg(tmp_path: Path, *extra: str):
    return train_cfg(
        tmp_path,
        "eagle3",
        LIVELY,
        "trainer.learning_rate=3e-3",
        "recipe.aux_layer_ids=[1,2,3]",
        "recipe.draft_vocab_size=200",
        "recipe.report.prompts=3",
        "recipe.report.max_new_tokens=8",
        "recipe.features.batch_size=4",
        "recipe.features.shard_records=8",
        "recipe.features.max_new_tokens=8",
        "recipe.features.max_records=16",
        *extra,
    )


def head_tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_eagle3(path)[0].state_dict().items()}


def test_eagle3_recipe_trains_exports_and_records(tmp_path):
    summary = recipes.run(eagle3_cfg(tmp_path, "recipe.speculative_tokens=4"))
    run, final = tmp_path / "run", tmp_path / "run" / "final"
    # final/ is the head in both dialects, equal to the trained head of the last checkpoint
    trained = {
        k.removeprefix("head."): v for k, v in load_file(run / "checkpoint-4" / "model.safetensors").items()
    }
    for path in (final, final / "sglang"):
        saved = head_tensors(path)
        assert set(saved) == set(trained)
        assert all(torch.equal(saved[k], trained[k]) for k in saved)
    config = json.loads((final / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX and config["draft_vocab_size"] == 200
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"]["name_or_path"] == "tiny-llama"
    assert "embed_tokens.weight" not in load_file(final / "model.safetensors")  # the target's: not saved
    assert summary["export_check"]["abs_diff"] == 0 and summary["base_weights_unchanged"]
    # acceptance.json: what auto plans from, consistent with the summary's figures
    record = read_record(final)
    (drafter,) = record.find("eagle3")
    figures = summary["acceptance"]
    assert drafter.acceptance == figures["conditional_acceptance"][0]
    assert sorted(drafter.tokens_per_round) == list(range(1, 9))
    assert all(1.0 <= v <= k + 1 for k, v in drafter.tokens_per_round.items())
    assert figures["answers"] == 3 and record.tokens == figures["tokens"] > 0
    assert set(figures["acceptance_length"]) == {3, 5}
    assert {"loss_0", "acc_0", "loss_2", "acc_2"} <= set(summary["metrics"]) | set(
        json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())["log_history"][0]
    )
    assert summary["features"]["sequences"] == 16 and summary["features"]["mode"] == "cache"


def test_the_generated_training_answers_become_the_corpus_auto_drafts_from_beside_the_head(tmp_path):
    """One generation serves the head and suffix decoding: ``final/corpus.sfx`` holds exactly the answers the
    target generated into the feature cache (training prompts only), their prompts' twin keys in its header,
    and ``answers.jsonl`` beside the cache holds the same; ``auto`` with ``drafter=final`` runs suffix
    decoding over that corpus first, the head after (exact)."""
    summary = recipes.run(eagle3_cfg(tmp_path, "recipe.report.enabled=false"))
    run, final = tmp_path / "run", tmp_path / "run" / "final"
    reader = ShardReader(run / "features")
    generated = [reader.read(i, ["targets"])["targets"].tolist() for i in range(len(reader))]
    model, tokenizer = tiny_model("tiny-llama")
    index = load_index(final / "corpus.sfx", fingerprint=corpus_fingerprint(tokenizer))
    assert len(generated) == 16 and [index.tokens[index.keys[i]] for i in range(len(index))] == generated
    answers = [json.loads(line) for line in (run / "features" / ANSWERS_FILE).read_text().splitlines()]
    assert [a["response_ids"] for a in answers] == generated
    data = load_group("data", "jsonl", DataConfig, path=str(tmp_path / "chat.jsonl"), held_out=4)
    trained = {first_user_turn(r) for r in load_records(data, "train")}
    held = {first_user_turn(r) for r in load_records(data, "held_out")}
    prompts = [a["prompt"] for a in answers]
    assert set(prompts) <= trained and len(held) == 4 and not set(prompts) & held
    assert corpus_prompt_keys(final / "corpus.sfx") == prompt_digests(prompts)
    assert summary["corpus"]["sequences"] == 16 and summary["corpus"]["tokens"] == sum(map(len, generated))
    # the head pays (a record written by hand): auto chains it after suffix decoding over the corpus
    rounds = {1: 1.97, 2: 2.9, 3: 3.8, 4: 4.7, 5: 5.5, 6: 6.3}
    write_record(final, AcceptanceRecord([DrafterRecord("eagle3", 0.97, tokens_per_round=rounds)]))
    fd = FastDecoder(model, tokenizer, drafter=str(final))
    prompt = [1, *generated[0][:6]]  # a training answer's start: the corpus continues it
    out = fd.generate([prompt], max_new_tokens=12, costs="estimated")
    assert out.candidate.name == "suffix+eagle3" and out.method == "eagle3"
    assert out.candidate.options["suffix"] == {"first": True, "corpus": str(final / "corpus.sfx")}
    assert out.output.by_proposer["suffix"][1] > 0  # drafted from the corpus
    cfg = DecodeConfig(max_new_tokens=12, eos_token_id=model.config.eos_token_id)
    assert out.ids == autoregressive(EarlyExitModel(model), [prompt], cfg).tokens
    # corpus= given explicitly wins over the one beside the head
    other = tmp_path / "other.sfx"
    other.write_bytes((final / "corpus.sfx").read_bytes())
    assert fd.generate([prompt], max_new_tokens=4, costs="estimated", corpus=str(other)).config.groups[
        "suffix"
    ].corpus == str(other)


def test_online_mode_computes_the_features_per_batch(tmp_path):
    summary = recipes.run(
        eagle3_cfg(
            tmp_path,
            "recipe.features.mode=online",
            "recipe.features.source=data",
            "recipe.loss=ce",
            "recipe.report.enabled=false",
        )
    )
    final = tmp_path / "run" / "final"
    assert summary["features"] == {"mode": "online"} and not (tmp_path / "run" / "features").exists()
    assert summary["export_check"]["abs_diff"] == 0 and summary["metrics"]["train_loss"] > 0
    assert load_eagle3(final)[1].draft_vocab_size == 200 and read_record(final) is None
    assert not (final / "corpus.sfx").exists()  # no answers generated: no corpus


@pytest.mark.parametrize("mode", ["cache", "online"])
def test_gradient_accumulation_trains_like_one_large_batch(tmp_path, mode):
    """4 answers in 1 micro-batch == 2 x 2: every micro-batch's loss is divided by the scored positions of the
    whole step (``step0_items``, counted by the trainer before any micro-batch runs), not by its own."""
    online = ("recipe.features.mode=online", "recipe.features.source=data") if mode == "online" else ()
    runs = {}
    for batch, accum in ((4, 1), (2, 2)):
        out = tmp_path / f"b{batch}"
        extra = (
            f"trainer.per_device_train_batch_size={batch}",
            f"trainer.gradient_accumulation_steps={accum}",
        )
        extra += ("trainer.max_steps=2", "trainer.save_steps=2", "recipe.report.enabled=false", *online)
        recipes.run(eagle3_cfg(out, *extra))
        state = json.loads((out / "run" / "checkpoint-2" / "trainer_state.json").read_text())
        runs[batch] = [v for h in state["log_history"] if "loss" in h for v in (h["loss"], h["grad_norm"])]
    assert len(runs[4]) == 4 and runs[4] == pytest.approx(
        runs[2], rel=1e-4
    )  # step 2: step 1's update matched


def test_step0_items_counts_what_the_loss_scores():
    """The trainer's count of a batch (``step0_items``) is the count ``ttt_loss`` divides by: cached records
    (``cols``) and online conversations (labels inside each row's length) alike."""
    labels = torch.full((2, 9), IGNORE_INDEX)
    labels[0, 3:7], labels[1, 1:9] = 5, 6  # row 1: label at index 1 (p = 0, never scored); row 1 is 6 long
    assert int(step0_items({"labels": labels, "lengths": torch.tensor([9, 6])})) == 4 + 4
    cols = torch.tensor([0, 1, 2, 5, 0, 3])
    assert int(step0_items({"cols": cols})) == 4


def test_a_run_resumes_from_its_checkpoint(tmp_path):
    fast = ("recipe.report.enabled=false", "resume_from_checkpoint=auto")
    recipes.run(eagle3_cfg(tmp_path, "trainer.max_steps=2", *fast))
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
    resumed = recipes.run(eagle3_cfg(tmp_path, *fast))  # steps 3 and 4 only
    state = json.loads((tmp_path / "run" / "checkpoint-4" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4]
    assert resumed["export_check"]["abs_diff"] == 0


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["recipe.aux_layer_ids=[1,2,4]"], r"recipe.aux_layer_ids=\[1, 2, 4\] .* 4 layers"),
        (["recipe.aux_layer_ids=null"], r"recipe.aux_layer_ids=null: .* gives \[2, 2, 1\]"),
        (["recipe.draft_vocab_size=262"], r"draft_vocab_size=262 .* \(261\)"),
        (["peft=lora"], "set peft=none"),
        (["recipe.features.mode=online"], "set recipe.features.source=data"),
        (
            ["recipe.features.mode=online", "recipe.features.source=data", "data.packing=true"],
            "packing=false",
        ),
        (["recipe.fc_norm=true", "recipe.norm_before_fc=true"], "mutually exclusive"),
        (["recipe.report.data=nope"], "recipe.report.data"),
    ],
)
def test_bad_settings_are_refused_before_the_weights_load(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr("recipes.finetune.load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match=message):
        recipes.run(eagle3_cfg(tmp_path, *overrides))


def test_ttt_metrics_stay_tensors():
    model = tiny_model("tiny-llama")[0]
    head = Eagle3Head(Eagle3Config.from_target(model.config, draft_vocab_size=261, aux_layer_ids=AUX))
    gen = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(261, (2, 6), generator=gen),
        "embeds": torch.randn(2, 6, 64, generator=gen),
        "features": torch.randn(2, 6, 192, generator=gen),
        "target_logits": torch.randn(2, 6, 261, generator=gen),
        "loss_mask": torch.ones(2, 6, dtype=torch.bool),
    }
    _, _, metrics = ttt_loss(head, batch, steps=2)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())


def random_head(model) -> Eagle3Head:
    head = Eagle3Head(Eagle3Config.from_target(model.config, draft_vocab_size=261, aux_layer_ids=AUX))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=gen))
    return head.eval()


def chain_accepted(head, m, ids: list[int], features, row: int, answer_next: list[int]) -> int:
    """Chain drafting by hand from ``row`` (the head's step 0 over rows ``0..row``, then each draft's own
    token and hidden state fed back, one position per step): how many drafts equal ``answer_next``."""
    tokens = torch.tensor([ids[1 : row + 2]])
    pos = torch.arange(1, row + 2)[None]
    kv = Eagle3KV()
    logits, hidden = head(m.embed(tokens, pos), features[:, : row + 1], pos, kv)
    hidden, accepted = hidden[:, -1:], 0
    for k, want in enumerate(answer_next):
        draft = head.draft_to_target(logits[0, -1].argmax())
        if int(draft) != want:
            break
        accepted += 1
        step_pos = pos[:, -1:] + k + 1
        logits, hidden = head(m.embed(draft.view(1, 1), step_pos), hidden, step_pos, kv)
    return accepted


@torch.no_grad()
def test_the_report_replays_chain_drafting_exactly():
    """An answer built from the head's own first drafts (so every start accepts at least one): the
    report's accepted run per start equals chain drafting by hand, with the drafts' own embeddings."""
    model = tiny_model("tiny-llama")[0]
    m, head = EarlyExitModel(model), random_head(model)
    gen = torch.Generator().manual_seed(1)
    prompt, n = [3, 50, 60, 70], 7
    features = torch.randn(1, len(prompt) + n - 1, 192, generator=gen)
    answer = [90]
    for j in range(1, n):  # a_j: the head's step-0 draft after a_0 .. a_{j-1}
        ids, row = prompt + answer, len(prompt) + j - 2
        tokens, pos = torch.tensor([ids[1 : row + 2]]), torch.arange(1, row + 2)[None]
        logits, _ = head(m.embed(tokens, pos), features[:, : row + 1], pos)
        answer.append(int(head.draft_to_target(logits[0, -1].argmax())))
    record = {"input_ids": torch.tensor(prompt + answer[:-1]), "targets": torch.tensor(answer)}
    record |= {f"h{a}": part for a, part in zip(AUX, features[0].chunk(3, dim=-1), strict=True)}
    lead, hits, tried = leading_matches(chain_drafts(head, m, record, AUX, 8), answer)
    ids = prompt + answer
    for j in range(1, n):
        by_hand = chain_accepted(head, m, ids, features, len(prompt) + j - 2, answer[j:])
        assert lead[j] == by_hand >= 1
    assert hits[0] == tried[0] == n - 1


def test_rounds_replay_the_accepted_runs():
    # one answer of 6 tokens; from start 1 two drafts match, from 4 one: K=2 -> rounds at 1 (3 tokens),
    # 4 (2 tokens: a_4 accepted, the verifier's a_5): 5 tokens in 2 rounds
    lead = [0, 2, 0, 0, 1, 0]
    assert replay_leads([lead], 2) == {1: 5 / 3, 2: 5 / 2}
