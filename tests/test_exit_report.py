"""Per-exit report: agreement and perplexity per exit, and the eval/exits.py entry point (the exit choice:
tests/test_cost.py)."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from fastdecode.config import CONFIG_DIR
from fastdecode.exit_report import generation_report, score_sequence
from fastdecode.model import EarlyExitModel
from tests.helpers import write_chat_jsonl


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


def test_eval_exits_entry_point_writes_json_and_plot(tmp_path):
    from eval.exits import run

    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=12)
    overrides = [
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=3",
        "prompts=2",
        "max_new_tokens=5",
        f"output_dir={tmp_path / 'out'}",
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        reports = run(compose(config_name="exits", overrides=overrides))
    saved = json.loads((tmp_path / "out" / "exits.json").read_text())
    assert saved["model"]["generations"]["agreement"]["4"] == 1.0
    assert set(reports["model"]["held_out"]["perplexity"]) == {1, 2, 3, 4}
    assert (tmp_path / "out" / "exits.png").is_file()
    # The recommendation comes from the cost model measured on the model, recorded beside it.
    assert (
        saved["model"]["costs"]["source"] == "measured"
        and saved["model"]["recommended"]["costs"] == "measured"
    )
