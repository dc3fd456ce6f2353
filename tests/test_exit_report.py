"""Per-exit report: agreement and perplexity per exit, and the eval/exits.py entry point (the exit choice:
tests/test_cost.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from fastdecode.config import CONFIG_DIR
from fastdecode.reports.exits import generation_report, score_sequence
from fastdecode.runtime.model import EarlyExitModel
from tests.helpers import write_chat_jsonl


def _layerskip_checkpoint(tmp_path: Path):
    """A tiny LayerSkip run's ``final/`` (weights, tokenizer, sidecar naming its base model): (model, path)."""
    import dataclasses

    from fastdecode.config import ModelConfig, load_group
    from fastdecode.files.checkpoint_info import write_sidecar
    from tests.helpers import tiny_model

    model, tokenizer = tiny_model("tiny-llama")
    checkpoint = tmp_path / "final"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    base = dataclasses.asdict(load_group("model", "tiny-llama", ModelConfig))
    write_sidecar(checkpoint, recipe="layerskip", run_name="layerskip-tiny-llama", base_model=base)
    return model, checkpoint


def test_final_exit_agrees_with_itself_and_scores_only_masked_positions(tiny_llama):
    m = EarlyExitModel(tiny_llama[0])
    ids = torch.randint(5, 261, (1, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(12, dtype=torch.bool)
    mask[4:9] = True
    agree, nll, n = score_sequence(m, ids, mask, labels=ids[0].roll(-1))
    assert n == 5 and agree[m.num_layers] == 5
    assert set(agree) == set(nll) == set(range(1, m.num_layers + 1))
    logits = tiny_llama[0](ids).logits[0, mask]
    expected = torch.nn.functional.cross_entropy(logits, ids[0].roll(-1)[mask], reduction="sum")
    assert nll[m.num_layers] == pytest.approx(expected.item(), rel=1e-5)


def test_agreement_on_own_generations_counts_generated_tokens(tiny_llama):
    model, tokenizer = tiny_llama
    m = EarlyExitModel(model)
    prompt = tokenizer("hello", add_special_tokens=False).input_ids
    gen = model.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False, min_new_tokens=7)
    report = generation_report(m, [(gen[0].tolist(), len(prompt))])
    assert report["tokens"] == 7
    assert report["agreement"][m.num_layers] == 1.0  # greedy tokens are the final layer's argmax


def run_exits(tmp_path, *overrides: str) -> dict:
    """``eval/exits.py`` on a 12-conversation chat jsonl (3 held out), 2 prompts of 5 new tokens."""
    from eval.exits import run

    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=12)
    base = ["data=jsonl", f"data.path={data}", "data.held_out=3", "prompts=2", "max_new_tokens=5"]
    base.append(f"output_dir={tmp_path / 'out'}")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return run(compose(config_name="exits", overrides=[*overrides, *base]))


def test_eval_exits_entry_point_writes_json_and_plot(tmp_path):
    reports = run_exits(tmp_path, "model=tiny-llama")
    saved = json.loads((tmp_path / "out" / "exits.json").read_text())
    assert saved["model"]["generations"]["agreement"]["4"] == 1.0
    assert set(reports["model"]["held_out"]["perplexity"]) == {1, 2, 3, 4}
    assert (tmp_path / "out" / "exits.png").is_file()
    # The recommendation comes from the cost model measured on the model, recorded beside it.
    assert (
        saved["model"]["costs"]["source"] == "measured"
        and saved["model"]["recommended"]["costs"] == "measured"
    )


def test_eval_exits_measures_the_cost_model_once_and_generates_once_per_model(tmp_path, monkeypatch):
    """A checkpoint, its base and an exit adapter: one cost-model measurement for the run (the two models
    have one shape), one set of greedy generations per model (the adapter report scores the exit report's),
    and every expected speedup printed as a sentence naming the machine it was measured on."""

    import fastdecode.plan.cost
    import fastdecode.reports.exits
    from fastdecode.runtime.machine import machine_label
    from fastdecode_cli.exits import summary_lines
    from tests.helpers import tiny_llama_adapter

    model, checkpoint = _layerskip_checkpoint(tmp_path)
    calls = {"measure_costs": 0, "greedy_generations": 0}

    def counted(name, original):
        def call(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        return call

    monkeypatch.setenv("FASTDECODE_COSTS", str(tmp_path / "costs"))  # none measured before on disk
    monkeypatch.setattr(
        fastdecode.plan.cost, "measure_costs", counted("measure_costs", fastdecode.plan.cost.measure_costs)
    )
    monkeypatch.setattr(
        fastdecode.reports.exits,
        "greedy_generations",
        counted("greedy_generations", fastdecode.reports.exits.greedy_generations),
    )
    adapter = tiny_llama_adapter(tmp_path, 2)
    reports = run_exits(tmp_path, "model=checkpoint", f"checkpoint={checkpoint}", f"adapter={adapter}")
    assert set(reports) == {"base", "checkpoint"} and "adapters" in reports["checkpoint"]
    assert calls == {"measure_costs": 1, "greedy_generations": 2}
    assert reports["base"]["costs"] == reports["checkpoint"]["costs"]  # one measurement, shared
    assert reports["checkpoint"]["adapters"]["recommended"]["costs"] == "measured"
    lines = summary_lines(reports)
    assert not any("{" in line for line in lines)  # sentences, no dict
    assert sum(f"(cost model measured on {machine_label()})" in line for line in lines) == 3


def test_eval_exits_records_what_auto_reads(tmp_path):
    """``record=true``: the checkpoint's ``acceptance.json`` (every exit with the full head and with its
    ``draft_vocab.json``) and the adapters' ``adapters.json`` (agreement, tokens per round), which the plan
    then prices; without a checkpoint or adapter it is refused before any work."""

    import torch

    from fastdecode.config import ConfigError
    from fastdecode.drafters.exits.record import recorded_adapter
    from fastdecode.files.draft_vocab_file import save_draft_vocab
    from fastdecode.plan.acceptance import read_record
    from tests.helpers import tiny_llama_adapter

    model, checkpoint = _layerskip_checkpoint(tmp_path)
    save_draft_vocab(checkpoint / "draft_vocab.json", torch.arange(60), vocab_size=model.config.vocab_size)
    adapter = Path(tiny_llama_adapter(tmp_path / "adapters", 2))  # a training run's final/: adapters.json
    (adapter.parent / "adapters.json").write_text(json.dumps({"adapters": {"2": adapter.name}, "chosen": 2}))
    with pytest.raises(ConfigError, match="record=true writes acceptance.json"):
        run_exits(tmp_path, "model=tiny-llama", "record=true")
    with pytest.raises(ConfigError, match="record=true with adapter=.*run's final/"):
        run_exits(tmp_path, f"checkpoint={checkpoint}", f"adapter={adapter}", "record=true")
    run_exits(
        tmp_path, "model=checkpoint", f"checkpoint={checkpoint}", f"adapter={adapter.parent}", "record=true"
    )
    record = read_record(checkpoint)
    heads = {(d.exit_layer, d.draft_vocab) for d in record.find("exit")}
    assert heads == {(e, v) for e in (1, 2, 3) for v in (None, "draft_vocab.json")}
    assert all(set(d.tokens_per_round) == set(range(1, 9)) for d in record.drafters)
    found = recorded_adapter(str(adapter))
    assert found.agreement is not None and set(found.tokens_per_round) == set(range(1, 9))
