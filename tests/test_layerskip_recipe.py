"""``recipe=layerskip`` end to end on a tiny model: export, reload, resume, LoRA, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import recipes
from fastdecode.config import ConfigError
from tests.job_configs import layerskip_cfg


def _history(run: Path, step: int) -> list[dict]:
    state = json.loads((run / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "loss" in h]


def test_layerskip_recipe_exports_a_plain_hf_checkpoint(tmp_path, capsys):
    summary = recipes.run(layerskip_cfg(tmp_path, "recipe.exit_layer=2", "recipe.draft_vocab_size=8"))
    printed = capsys.readouterr().out
    # The closing lines: a small table and one sentence naming what auto runs and the machine, no raw dict.
    from fastdecode.runtime.machine import machine_label

    header = "| decoder | drafter | exit | recorded acceptance | expected | measured | tok/s |"
    closing = printed[printed.index(header) :].strip().splitlines()  # the last thing the run prints
    assert closing[-1].startswith("auto runs prompt_lookup") and f"{machine_label()})" in closing[-1]
    assert all(line.startswith("| ") for line in closing[:-1]) and "{" not in "".join(closing)
    # The checkpoint carries its own record: every exit but the last, full head and draft vocabulary.
    from fastdecode.plan.acceptance import read_record

    record = read_record(summary["checkpoint"])
    assert {(d.exit_layer, d.draft_vocab) for d in record.find("exit")} == {
        (e, v) for e in (1, 2, 3) for v in (None, "draft_vocab.json")
    }
    assert all(d.tokens_per_round and 0 <= d.acceptance <= 1 for d in record.drafters)
    run = tmp_path / "run"
    vocab = json.loads(Path(summary["draft_vocab"]).read_text())  # the most frequent trained-on tokens
    assert Path(summary["draft_vocab"]).parent == Path(summary["checkpoint"]) and vocab["size"] == 8
    assert 4 in vocab["ids"]  # EOS (a special token) is always draftable
    assert summary["export_check"]["abs_diff"] == 0  # the saved fp32 weights, reloaded: the same forward
    assert summary["metrics"]["eval_loss/exit_4"] > 0  # evaluation logs the exit losses too (the last one)
    reloaded = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    sidecar = json.loads((Path(summary["checkpoint"]) / "fastdecode.json").read_text())
    assert sidecar["exit_layer"] == summary["recommended_exit"]["exit"] == 2
    assert sidecar["run_name"] == "layerskip-tiny-llama" and sidecar["base_model"]["name"] == "tiny-llama"
    # Not in generation_config: plain generate() would self-speculate and refuse batches larger than one.
    assert GenerationConfig.from_pretrained(summary["checkpoint"]).assistant_early_exit is None
    report = json.loads((run / "exit_report.json").read_text())
    assert set(report["before"]["generations"]["agreement"]) == {str(i) for i in range(1, 5)}
    assert (run / "exit_report.png").is_file()
    # The closing speed line: every decoder of the plan (what the measured cost model expects to pay with
    # the recorded acceptance) against autoregressive decoding, the same tokens; an exit that does not pay
    # is named as such.
    speed, plan = report["speed"], report["speed"]["plan"]
    assert (
        report["costs"]["source"] == "measured"
        and speed["best"] in speed["decoders"]
        and speed["speedup"] > 0
    )
    assert [c["name"] for c in plan["candidates"]] == list(speed["decoders"])
    assert all(r["tokens"] == speed["autoregressive"]["tokens"] > 0 for r in speed["decoders"].values())
    exits = [c["options"].get("exit_layer") for c in plan["candidates"]] + [
        n["exit"] for n in plan["not_paying"]
    ]
    assert exits.count(None) == 1 and {e for e in exits if e is not None} <= {1, 2, 3}
    logs = _history(run, 4)
    assert len(logs) == 4 and all("loss/exit_4" in h for h in logs)  # the last exit is always on
    rotated = [sorted(k for k in h if k.startswith("loss/exit_")) for h in logs]
    assert rotated[0] != rotated[1]  # the default strided curriculum: the active exits change per step
    _plain_transformers_batches(summary["checkpoint"], reloaded)
    _library_generates(summary["checkpoint"])


def _plain_transformers_batches(checkpoint: str, reloaded) -> None:
    """Batched ``generate`` and ``pipeline(batch_size=2)`` on the export, as any serving stack calls them."""
    from transformers import AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.padding_side = "left"
    batch = tokenizer(["Hello there", "Hi"], return_tensors="pt", padding=True)
    out = reloaded.generate(**batch, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (2, batch["input_ids"].shape[1] + 5)
    generator = pipeline("text-generation", model=checkpoint, tokenizer=tokenizer, batch_size=2, device="cpu")
    results = generator(["Hello there", "Hi", "Hey"], max_new_tokens=4, do_sample=False)
    assert len(results) == 3 and all(r[0]["generated_text"] for r in results)


def _library_generates(checkpoint: str) -> None:
    """``fastdecode.from_pretrained`` on the export self-speculates at its recorded E, and by default decodes
    with what the cost model expects to pay; losslessly either way."""
    import fastdecode

    fd = fastdecode.from_pretrained(checkpoint, device="cpu", dtype="float32")
    fast = fd.generate("Hello there", max_new_tokens=8, method="self_speculative")
    assert fast.config.exit_layer == 2 and fast.output.drafted
    auto = fd.generate("Hello there", max_new_tokens=8)
    assert auto.method == fd.plan().best.method
    assert (
        fast.text == auto.text == fd.generate("Hello there", max_new_tokens=8, method="autoregressive").text
    )


def test_opting_in_writes_the_exit_into_generation_config(tmp_path):
    """``recipe.export.hf_assistant_early_exit=true``: plain ``generate()`` self-speculates, losslessly."""
    summary = recipes.run(
        layerskip_cfg(
            tmp_path,
            "recipe.exit_layer=2",
            "recipe.report.enabled=false",
            "recipe.export.hf_assistant_early_exit=true",
        )
    )
    reloaded = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    exit_e = GenerationConfig.from_pretrained(summary["checkpoint"]).assistant_early_exit
    assert exit_e == 2
    ids = torch.tensor([[3, 50, 60, 70, 80]])
    speculative = reloaded.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    no_spec = GenerationConfig.from_dict(
        {**reloaded.generation_config.to_dict(), "assistant_early_exit": None}
    )
    plain = reloaded.generate(
        ids, generation_config=no_spec, max_new_tokens=12, do_sample=False, min_new_tokens=12
    )
    assert reloaded.generation_config.assistant_early_exit == exit_e
    assert speculative.tolist() == plain.tolist()


@pytest.mark.parametrize("useful", [True, False])
def test_the_exit_choice_from_the_report_goes_into_the_sidecar(tmp_path, monkeypatch, caplog, useful):
    import layerskip_train.recipe as recipe
    from fastdecode.runtime.machine import machine_label

    found = {"exit": 3, "draft": 1, "expected_speedup": 0.78}  # what choose_exit returns when none pays
    fake = {"exit": 3, "draft": 2, "expected_speedup": 1.4} if useful else {"exit": None, "draft": 0}
    fake |= {"costs": "measured"} | ({} if useful else {"expected_speedup": 1.0, "best_found": found})
    monkeypatch.setattr(recipe, "choose_exit", lambda agreement, costs, **kw: dict(fake))
    with caplog.at_level("INFO", logger="layerskip_train.recipe"):
        summary = recipes.run(layerskip_cfg(tmp_path))
    saved = json.loads((Path(summary["checkpoint"]) / "fastdecode.json").read_text())["exit_layer"]
    assert saved == fake["exit"] == summary["recommended_exit"]["exit"]  # None: no exit recorded
    assert GenerationConfig.from_pretrained(summary["checkpoint"]).assistant_early_exit is None
    # One plain sentence at INFO (no exit paying is the usual outcome of a short CPU run), no dict in it.
    [record] = [r for r in caplog.records if "of autoregressive decoding" in r.getMessage()]
    message, machine = record.getMessage(), f"(cost model measured on {machine_label()})"
    assert record.levelname == "INFO" and "{" not in message and machine in message
    if useful:
        assert message.startswith("recommended exit E=3 with K=2 drafts, expected at 1.40x of autoregressive")
    else:
        assert message.startswith(
            "no exit is expected to speed decoding up yet: the best, E=3 with K=1, is expected at 0.78x of "
            f"autoregressive decoding {machine}; no exit recorded; method=auto decodes with prompt lookup"
        )


def test_the_training_log_lists_the_exits_in_order(tmp_path):
    """A log spanning two steps of the strided curriculum (exit 1, then exit 2; the last always) lists
    loss/exit_E in increasing E, as the Trainer prints it, not in the order the curriculum trained them."""
    from layerskip_train.recipe import LayerSkip
    from recipes.common import load_job
    from recipes.finetune import finetune

    cfg = layerskip_cfg(tmp_path, "recipe.report.enabled=false", "trainer.logging_steps=2")
    job = load_job(cfg)
    logs = [h for h in finetune(job, cfg, LayerSkip(job)).trainer.state.log_history if "loss" in h]
    exits = [[k for k in h if k.startswith("loss/exit_")] for h in logs]  # in the order they are printed
    assert len(exits) == 2 and exits[0] == ["loss/exit_1", "loss/exit_2", "loss/exit_4"]
    assert all(e == sorted(e, key=lambda k: int(k.rsplit("_", 1)[1])) for e in exits)


# torchtune's rotational curriculum on one candidate exit of the 4-layer model: exits {1,3} {2,3} {3} {0,3};
# a curriculum restarted on resume (as torchtune's is) would train {1,3} again at step 2.
ROTATIONAL_ONE_EXIT = ("recipe.early_exit_loss.curriculum=rotational", "recipe.early_exit_loss.layers='1'")


@pytest.mark.parametrize("curriculum", [(), ROTATIONAL_ONE_EXIT], ids=["strided", "rotational"])
def test_resume_repeats_the_same_losses(tmp_path, monkeypatch, curriculum):
    """N steps straight == N/2, crash, resume, N/2: same drops, same curriculum, same data order."""
    straight = tmp_path / "straight"
    straight.mkdir()
    recipes.run(layerskip_cfg(straight, "recipe.report.enabled=false", *curriculum))
    history = _history(straight / "run", 4)
    expected = [round(h["loss"], 5) for h in history]
    expected_exits = [sorted(k for k in h if k.startswith("loss/exit_")) for h in history]
    if curriculum:
        assert expected_exits == [
            ["loss/exit_2", "loss/exit_4"],
            ["loss/exit_3", "loss/exit_4"],
            ["loss/exit_4"],
            ["loss/exit_1", "loss/exit_4"],
        ]

    from layerskip_train.trainer import LayerSkipTrainer

    crashed = tmp_path / "crashed"
    crashed.mkdir()
    original = LayerSkipTrainer.training_step

    def crash_after_checkpoint(self, *args, **kwargs):
        if self.state.global_step == 2:  # checkpoint-2 is saved: die like a killed job
            raise KeyboardInterrupt("simulated kill")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LayerSkipTrainer, "training_step", crash_after_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        recipes.run(layerskip_cfg(crashed, "recipe.report.enabled=false", *curriculum))
    monkeypatch.setattr(LayerSkipTrainer, "training_step", original)
    recipes.run(
        layerskip_cfg(crashed, "recipe.report.enabled=false", "resume_from_checkpoint=auto", *curriculum)
    )
    resumed_history = _history(crashed / "run", 4)
    assert [round(h["loss"], 5) for h in resumed_history] == expected
    assert [sorted(k for k in h if k.startswith("loss/exit_")) for h in resumed_history] == expected_exits


def test_lora_adapters_train_merge_and_reload(tmp_path):
    summary = recipes.run(layerskip_cfg(tmp_path, "peft=lora", "peft.r=4", "trainer.learning_rate=1e-2"))
    check = summary["export_check"]  # merged weights reproduce the live LoRA model, within rounding
    assert check["abs_diff"] <= check["tolerance"]
    merged = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    assert not any("lora" in name for name, _ in merged.named_parameters())
    from fastdecode.config import ModelConfig, load_group
    from fastdecode.runtime.loading import load_model

    base, _ = load_model(load_group("model", "tiny-llama", ModelConfig))
    changed = [
        n for n, p in merged.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])
    ]
    assert any("q_proj" in n for n in changed)  # the LoRA weights trained and were merged into the weights


@pytest.mark.parametrize(
    "override,message",
    [
        ("recipe.exit_layer=4", r"exit_layer=4 must be in \[1, 3\]"),
        ("recipe.exit_layer=0", r"exit_layer=0 must be in \[1, 3\]"),
        ("recipe.early_exit_loss.layers='0,9'", r"9.*out of range|outside"),
        ("recipe.layer_dropout.layers='5:'", r"5"),
        ("recipe.layer_dropout.prob=1.0", r"prob must be in \[0, 1\)"),
        ("recipe.layer_dropout.prob=-0.1", r"prob must be in \[0, 1\)"),
        ("recipe.early_exit_loss.scale_fn=log_l", r"Unknown early exit scale function 'log_l'.*Choices"),
        ("recipe.early_exit_loss.curriculum=cosine", r"Unknown curriculum 'cosine'.*rotational"),
        ("+recipe.early_exit_loss.rotation=4", r"Unknown key 'recipe\.early_exit_loss\.rotation'"),
        ("recipe.layer_dropout.layers_scale=cubic", r"Unknown .*'cubic'.*exp"),
        ("recipe.report.data=sharegtp", r"Unknown recipe.report.data 'sharegtp'.*sharegpt"),
    ],
)
def test_bad_recipe_config_fails_before_training(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        recipes.run(layerskip_cfg(tmp_path, override))
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_deepspeed_batch_arithmetic_is_checked_before_loading(tmp_path, monkeypatch):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 999, "zero_optimization": {"stage": 2}}))
    monkeypatch.setattr("fastdecode.runtime.loading.load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(
        ConfigError, match=r"train_batch_size=999 but micro batch 4 x gradient accumulation 1"
    ):
        recipes.run(layerskip_cfg(tmp_path, f"deepspeed.config_file={bad}"))


def test_activation_checkpointing_gives_the_same_losses(tmp_path):
    plain = tmp_path / "plain"
    ckpt = tmp_path / "ckpt"
    plain.mkdir()
    ckpt.mkdir()
    recipes.run(layerskip_cfg(plain, "recipe.report.enabled=false"))
    recipes.run(layerskip_cfg(ckpt, "recipe.report.enabled=false", "+trainer.activation_checkpointing=true"))
    losses = [[round(h["loss"], 4) for h in _history(p / "run", 4)] for p in (plain, ckpt)]
    assert losses[0] == losses[1]


def test_wandb_without_credentials_logs_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    summary = recipes.run(layerskip_cfg(tmp_path, "recipe.report.enabled=false", "trainer.report_to=wandb"))
    import os

    assert os.environ["WANDB_MODE"] == "offline"
    monkeypatch.delenv("WANDB_MODE")
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert summary["metrics"]["train_loss"] > 0


def test_activation_checkpointing_really_recomputes_blocks():
    import copy

    from fastdecode.config import ModelConfig, load_group
    from fastdecode.runtime.loading import load_model
    from layerskip_train.config import LayerSkipConfig
    from layerskip_train.module import EarlyExitLM

    model, _ = load_model(load_group("model", "tiny-llama", ModelConfig))
    calls = []
    for enable in (False, True):
        module = EarlyExitLM(copy.deepcopy(model), LayerSkipConfig(), seed=0, total_steps=4).train()
        if enable:
            module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        seen: list[int] = []
        module.m.layers[1].self_attn.register_forward_pre_hook(lambda *a, seen=seen: seen.append(1))
        ids = torch.randint(5, 261, (2, 9))
        module(input_ids=ids, labels=ids)["loss"].backward()
        calls.append(len(seen))
    assert calls == [1, 2]  # the block runs again in backward when checkpointing is on
