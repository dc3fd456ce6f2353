"""The model's own answers reused as a suffix corpus: ``fastdecode-suffix-index`` indexes ``response_ids``
exactly as generated (``fastdecode-regenerate``'s jsonl, a feature cache's ``answers.jsonl``) and records its
prompts' twin keys; ids of another tokenizer are refused by name, before anything is written."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from fastdecode.config import CONFIG_DIR, ConfigError
from fastdecode.data.chat import user_prompt_ids
from fastdecode.data.twins import prompt_digests
from fastdecode.decoding.config import DecodeConfig
from fastdecode.drafters.suffix.index_file import load_index
from fastdecode.registry import corpus_fingerprint, corpus_prompt_keys, get_decoder
from fastdecode.runtime.model import EarlyExitModel
from fastdecode_cli.regenerate import run as regenerate
from fastdecode_cli.suffix_index import run as suffix_index
from tests.helpers import tiny_model, write_chat_jsonl


def build(source, output, *extra: str) -> dict:
    overrides = ["model=tiny-llama", f"input={source}", f"output={output}", *extra]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return suffix_index(compose(config_name="suffix_index", overrides=overrides))


def sequences(path) -> list[list[int]]:
    index = load_index(path, fingerprint=corpus_fingerprint(tiny_model("tiny-llama")[1]))
    return [index.tokens[key] for key in index.keys.values()]


def test_regenerated_answers_index_as_their_generated_ids_with_their_prompts_keys(tmp_path):
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=10)
    overrides = ["model=tiny-llama", "data=jsonl", f"data.path={data}", "data.held_out=2", "num_prompts=5"]
    overrides += ["max_new_tokens=6", "batch_size=3", f"output={tmp_path / 'own.jsonl'}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        regenerate(compose(config_name="regenerate", overrides=overrides))
    lines = [json.loads(line) for line in (tmp_path / "own.jsonl").read_text().splitlines()]
    model, tokenizer = tiny_model("tiny-llama")
    prompts = [user_prompt_ids(tokenizer, line["prompt"]) for line in lines]
    cfg = DecodeConfig(max_new_tokens=6, eos_token_id=tokenizer.eos_token_id)
    generated = get_decoder("autoregressive")(EarlyExitModel(model), prompts, cfg).tokens
    assert [line["response_ids"] for line in lines] == generated
    built = build(tmp_path / "own.jsonl", tmp_path / "own.sfx")
    assert sequences(tmp_path / "own.sfx") == generated  # the ids as generated, not the text re-tokenized
    assert corpus_prompt_keys(tmp_path / "own.sfx") == prompt_digests(line["prompt"] for line in lines)
    assert built["prompt_keys"] == 5


def test_given_ids_are_kept_text_is_tokenized_and_eos_is_appended_once(tmp_path):
    tokenizer = tiny_model("tiny-llama")[1]
    eos = tokenizer.eos_token_id
    rows = [
        {"prompt": "Hi!", "response": "ignored text", "response_ids": [40, 41, eos]},
        {"prompt": "hi", "response": "ab"},  # a twin of the first prompt: one key
        {"text": "cd"},  # no prompt: no key
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    build(tmp_path / "a.jsonl", tmp_path / "a.sfx", "append_eos=true")
    text = [tokenizer(t, add_special_tokens=False).input_ids for t in ("ab", "cd")]
    assert sequences(tmp_path / "a.sfx") == [[40, 41, eos], text[0] + [eos], text[1] + [eos]]
    assert corpus_prompt_keys(tmp_path / "a.sfx") == prompt_digests(["hi"])


@pytest.mark.parametrize(
    ("ids", "match"),
    [([5, "6"], "must be a list of token ids"), ([5, -1], "must be a list"), ([5, 9999], "token id 9999")],
)
def test_response_ids_of_another_tokenizer_are_refused(tmp_path, ids, match):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"prompt": "q", "response": "x", "response_ids": ids}) + "\n"
    )
    with pytest.raises(ConfigError, match=match):
        build(tmp_path / "a.jsonl", tmp_path / "a.sfx")
    assert not (tmp_path / "a.sfx").exists()
