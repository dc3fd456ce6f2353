"""Self-distillation data: the model's own greedy answers, resumable, never from benchmarks."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from fastdecode.config import CONFIG_DIR, ConfigError, load_group
from fastdecode.data.chat import user_prompt_ids
from fastdecode.data.config import DataConfig
from fastdecode.data.sources import read_records
from fastdecode.data.splits import split_records
from fastdecode.decoding.config import DecodeConfig
from fastdecode.registry import get_decoder
from fastdecode.runtime.model import EarlyExitModel
from fastdecode_cli.regenerate import run
from tests.helpers import second_eos_loader, tiny_model, write_chat_jsonl


def _cfg(tmp_path, *extra):
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=12)
    overrides = [
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=4",
        "max_new_tokens=6",
        "batch_size=3",
        f"output={tmp_path / 'own.jsonl'}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="regenerate", overrides=overrides)


def test_answers_are_the_models_greedy_output_and_a_rerun_resumes(tmp_path):
    first = run(_cfg(tmp_path, "num_prompts=4"))
    lines = (tmp_path / "own.jsonl").read_text().splitlines()
    assert first["new"] == 4 and len(lines) == 4
    more = run(_cfg(tmp_path, "num_prompts=7"))
    lines_after = (tmp_path / "own.jsonl").read_text().splitlines()
    assert more["new"] == 3 and lines_after[:4] == lines  # earlier answers are kept, not redone
    model, tok = tiny_model("tiny-llama")
    rec = json.loads(lines_after[5])
    ids = user_prompt_ids(tok, rec["prompt"])
    templated = tok.apply_chat_template(
        [{"role": "user", "content": rec["prompt"]}], add_generation_prompt=True
    )
    assert ids == list(templated["input_ids"] if hasattr(templated, "keys") else templated)
    alone = get_decoder("autoregressive")(
        EarlyExitModel(model), [ids], DecodeConfig(max_new_tokens=6, eos_token_id=tok.eos_token_id)
    )
    assert rec["response"] == tok.decode(alone.tokens[0], skip_special_tokens=True)
    # Prompts come from the training split only: none of them is a held-out prompt.
    data = load_group("data", "jsonl", DataConfig, path=str(tmp_path / "chat.jsonl"), held_out=4)
    _, held_out, _ = split_records(read_records(data), 4, data.split_seed)
    held = {r["messages"][0]["content"] for r in held_out}
    assert len(held) == 4 and not held & {json.loads(line)["prompt"] for line in lines_after}


def test_benchmarks_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="evaluation"):
        run(_cfg(tmp_path, "data=mt_bench"))


def test_a_second_eos_of_the_generation_config_ends_the_answers(tmp_path, monkeypatch):
    """The model's generation config declares a second EOS id (``fastdecode.tokens.eos_ids``): every answer
    stops there (the tokenizer's EOS alone would run on for max_new_tokens=6)."""
    import fastdecode.runtime.loading

    declared: list[int] = []
    monkeypatch.setattr(
        fastdecode.runtime.loading,
        "load_model",
        second_eos_loader(fastdecode.runtime.loading.load_model, declared),
    )
    run(_cfg(tmp_path, "num_prompts=4"))
    tokenizer = tiny_model("tiny-llama")[1]
    answers = [json.loads(line)["response"] for line in (tmp_path / "own.jsonl").read_text().splitlines()]
    assert answers == [tokenizer.decode(declared, skip_special_tokens=True)] * 4
