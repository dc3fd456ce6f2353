"""SkipDecode: the policy's properties, one meaning per option for training and decoding, exactness of the
teacher-forced training forward against token-by-token decoding, the KV cache written and read only where the
policy runs, the recipe end to end and the policy it records, ROUGE-L, bad input."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

import recipes
from fastdecode.config import CONFIG_DIR, ConfigError
from fastdecode.decoding.autoregressive import step
from fastdecode.decoding.common import prefill
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.skipdecode import policy_from_config
from fastdecode.registry import DECODERS
from fastdecode.reports.skipdecode import lcs_length, rouge_l, skipdecode_quality, split_examples
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.skipdecode import (
    SkipDecodePolicy,
    SkipOptions,
    SkipPolicyMismatchError,
    policy_hidden,
    read_trained_policy,
    response_starts,
    save_trained_policy,
    trained_options,
)
from skipdecode_train.config import SkipDecodeConfig
from skipdecode_train.module import SkipDecodeLM
from tests.conftest import ENGINES, REFERENCE, TINY_MODELS
from tests.helpers import lively_model, model_tolerance, random_prompts, write_chat_jsonl

skipdecode = DECODERS["skipdecode"]
NEW = 12


# --------------------------------------------------------------------------------------------------------
# Policy
def _random_policy(rng: random.Random) -> SkipDecodePolicy:
    layers = rng.randint(1, 40)
    warmup = rng.randint(0, layers - 1)
    low = rng.randint(warmup + 1, layers)
    return SkipDecodePolicy(layers, rng.randint(low, layers), low, warmup, rng.randint(2, 300))


def test_policy_properties_over_random_configs():
    rng = random.Random(0)
    for _ in range(300):
        policy = _random_policy(rng)
        big_l, w = policy.num_layers, policy.warmup_layers
        prompt = rng.randint(1, policy.max_length - 1)
        total = prompt + rng.randint(0, 2 * policy.max_length)
        b = policy.budgets(prompt, total)
        assert b.shape == (total,) and (b[:prompt] == big_l).all()  # prompt at full depth
        response = b[prompt:]
        assert ((response >= policy.min_budget) & (response <= policy.max_budget)).all()
        assert (b[1:] <= b[:-1]).all()  # non-increasing
        span = policy.max_length - prompt
        k = torch.arange(len(response))
        linear = policy.max_budget - (policy.max_budget - policy.min_budget) * k / span
        assert ((response - linear.clamp(min=policy.min_budget)).abs() <= 0.5).all()  # linear, rounded
        if len(response) > span:
            assert response[span:].eq(policy.min_budget).all() and response[0] == policy.max_budget
        runs = policy.runs_layer(b)  # [L, T]
        assert runs[:w].all() and runs[-1].all()  # warm-up and the top layer always run
        assert torch.equal(runs.sum(0), b)  # exactly b(t) layers
        assert (runs[:, 1:] <= runs[:, :-1]).all()  # S(t) ⊆ S(t') for t' < t: no KV recomputation
        for t in rng.sample(range(total), min(total, 3)):
            warm, top = policy.layer_ranges(int(b[t]))
            assert torch.equal(runs[:, t].nonzero().flatten(), torch.tensor([*warm, *top], dtype=torch.long))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_budget=2, min_budget=3), r"min_budget=3 > max_budget=2"),
        (dict(max_budget=5, min_budget=2), r"max_budget=5 is outside \[2, 4\]"),
        (dict(max_budget=4, min_budget=1), r"min_budget=1 is outside \[2, 4\]"),
        (dict(max_budget=4, min_budget=3, warmup_layers=3), r"min_budget=3 is outside \[4, 4\]"),
        (dict(max_budget=4, min_budget=4, warmup_layers=4), r"warmup_layers=4 .* <= 3"),
        (dict(max_budget=4, min_budget=2, max_length=0), r"max_length=0"),
    ],
)
def test_bad_policy_raises(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SkipDecodePolicy(num_layers=4, **({"max_length": 64} | kwargs))


def test_bad_decoder_input_raises_before_any_model_work():
    m = lively_model("tiny-llama")
    with pytest.raises(ConfigError, match=r"skip.min_budget=3 > decoder.skip.max_budget=2"):
        DecodeConfig(max_new_tokens=4, skip=SkipOptions(max_budget=2, min_budget=3))
    with pytest.raises(ConfigError, match=r"decoder.skip.max_budget=9 is outside \[2, 4\]"):
        skipdecode(m, [[5, 6]], DecodeConfig(max_new_tokens=4, skip=SkipOptions(max_budget=9)))
    with pytest.raises(ConfigError, match=r"exit_layer=2: skipdecode always ends at the last layer"):
        skipdecode(m, [[5, 6]], DecodeConfig(max_new_tokens=4, exit_layer=2))
    with pytest.raises(ConfigError, match=r"skip.max_length=5 but the longest prompt has 6 tokens"):
        skipdecode(m, [[5] * 6, [7]], DecodeConfig(max_new_tokens=4, skip=SkipOptions(max_length=5)))


# --------------------------------------------------------------------------------------------------------
# Exactness: training forward == token-by-token decoding
def _teacher_forced(m: EarlyExitModel, prompts, continuations) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``/``labels`` of prompt + continuation rows (labels on the continuation)."""
    seqs = [p + c for p, c in zip(prompts, continuations, strict=True)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    for row, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        ids[row, : len(s)] = torch.tensor(s)
        labels[row, len(p) : len(s)] = torch.tensor(s[len(p) :])
    return ids, labels


@torch.no_grad()
def _stepwise_logits(m, policy, prompts, continuations) -> torch.Tensor:
    """``[B, N, V]``: logits after the prompt and after each continuation token, decoded with the cache."""
    width = max(map(len, prompts))
    state = prefill(m, prompts, width + NEW)
    budgets = policy.response_budgets(NEW, width).tolist()
    logits, positions = [state.logits], state.positions
    valid = torch.ones(len(prompts), dtype=torch.bool)
    for k in range(len(continuations[0]) - 1):
        tokens = torch.tensor([c[k] for c in continuations])
        logits.append(step(m, state.cache, tokens, positions, valid, layers=policy.layer_ranges(budgets[k])))
        positions = positions + 1
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("engine", ["hf", "packed"])
@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("warmup,high,low", [(1, 3, 2), (0, 4, 1), (2, 4, 3)])
def test_training_forward_equals_token_by_token_decoding(name, batch, warmup, high, low, engine):
    m = lively_model(name)
    prompts = random_prompts(batch, seed=batch + warmup)
    cfg = DecodeConfig(
        max_new_tokens=NEW,
        skip=SkipOptions(max_budget=high, min_budget=low, warmup_layers=warmup),
        **ENGINES[engine],
    )
    out = skipdecode(m, prompts, cfg)
    policy = policy_from_config(cfg, m.num_layers, max(map(len, prompts)))
    ids, labels = _teacher_forced(m, prompts, out.tokens)
    with torch.no_grad():
        forced = m.exit_logits(policy_hidden(m, policy, ids, labels))  # [B, T, V]
        loss = SkipDecodeLM(m.hf, policy)(input_ids=ids, labels=labels)["loss"]
    stepwise = _stepwise_logits(m, policy, prompts, out.tokens)  # [B, NEW, V]
    width = ids.shape[1]  # one teacher-forced pass against the cache, token by token
    for row, prompt in enumerate(prompts):
        rows = forced[row, len(prompt) - 1 : len(prompt) - 1 + NEW]
        torch.testing.assert_close(rows, stepwise[row], **model_tolerance(m.config, width, stepwise[row]))
        assert rows.argmax(-1).tolist() == out.tokens[row]  # greedy output = argmax of the training forward
    targets = torch.tensor(out.tokens)  # every row generated NEW tokens (no EOS)
    expected = F.cross_entropy(stepwise.flatten(0, 1), targets.flatten())  # stepwise[:, k] predicts token k
    # the trained loss is the decoder's: the same logits, then the log-softmax and the mean over the tokens
    tol = model_tolerance(m.config, width, expected, m.vocab_size + targets.numel())
    torch.testing.assert_close(loss, expected, **tol)
    fed = policy.response_budgets(NEW - 1, max(map(len, prompts)))  # the last token is emitted, not fed
    assert out.layers_run == batch * int(fed.sum())


class _CacheSpy(EarlyExitModel):
    """Keeps the cache a decoder allocates, so the test can inspect it after ``generate``."""

    def new_cache(self, batch_size: int, capacity: int, extra_layers: int = 0):
        self.cache = super().new_cache(batch_size, capacity, extra_layers)
        return self.cache


def test_cache_is_written_and_read_only_where_the_policy_runs():
    m = _CacheSpy(lively_model("tiny-llama").hf)
    big_l, prompts = m.num_layers, random_prompts(3, seed=5)
    width = max(map(len, prompts))
    seen: list[tuple[int, int, int]] = []  # (layer, its cache length, the step's slot) at each layer call
    hooks = [
        layer.register_forward_pre_hook(
            lambda *_, i=i: seen.append((i, m.cache.lengths[i], m.cache.lengths[big_l - 1]))
        )
        for i, layer in enumerate(m.layers)
    ]
    try:
        # the reference path: the spy counts the cache calls the HF layers make
        skip = SkipOptions(max_budget=4, min_budget=1, warmup_layers=0)
        cfg = DecodeConfig(max_new_tokens=NEW, skip=skip, **REFERENCE)
        out = skipdecode(m, prompts, cfg)
    finally:
        for hook in hooks:
            hook.remove()
    policy = policy_from_config(cfg, big_l, width)
    runs = policy.runs_layer(policy.response_budgets(out.steps, width))  # [L, steps]
    expected = width + runs.sum(1)  # prompt slots at every layer, then the steps that ran the layer
    assert m.cache.lengths == expected.tolist() == m.cache.writes  # never written where skipped
    assert m.cache.lengths[0] < m.cache.lengths[-1]  # layer 0 really was skipped (warmup_layers=0)
    decode_calls = [(i, length, slot) for i, length, slot in seen if slot >= width]
    assert len(decode_calls) == int(runs.sum())
    # Each layer that runs holds the keys/values of every earlier slot: nothing missing is ever read.
    assert all(length == slot for _, length, slot in decode_calls)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_full_budget_equals_autoregressive(name, engine):
    m = lively_model(name)
    prompts = random_prompts(3, seed=7)
    cfg = DecodeConfig(max_new_tokens=16, eos_token_id=m.config.eos_token_id)
    full = replace_cfg(
        cfg, skip=SkipOptions(max_budget=m.num_layers, min_budget=m.num_layers), **ENGINES[engine]
    )
    reference = DECODERS["autoregressive"](m, prompts, replace_cfg(cfg, **REFERENCE))
    ours = skipdecode(m, prompts, full)
    assert ours.tokens == reference.tokens
    assert (ours.layers_run, ours.layer_calls) == (reference.layers_run, reference.layer_calls)


def replace_cfg(cfg: DecodeConfig, **changes) -> DecodeConfig:
    from dataclasses import replace

    return replace(cfg, **changes)


# --------------------------------------------------------------------------------------------------------
# Quality report
def test_rouge_l_and_lcs():
    assert rouge_l([1, 2, 3, 4], [1, 2, 4]) == pytest.approx(2 * 0.75 * 1 / 1.75)
    assert rouge_l([5, 6], [5, 6]) == 1.0 and rouge_l([1], [2]) == 0.0
    assert rouge_l([], []) == 1.0 and rouge_l([], [1]) == 0.0
    rng = random.Random(1)
    for _ in range(50):  # against brute force over subsequences
        a = [rng.randint(0, 3) for _ in range(rng.randint(0, 7))]
        b = [rng.randint(0, 3) for _ in range(rng.randint(0, 7))]
        brute = max(
            (n for n in range(len(a) + 1) for sub in itertools.combinations(a, n) if _is_subsequence(sub, b)),
            default=0,
        )
        assert lcs_length(a, b) == lcs_length(b, a) == brute


def _is_subsequence(sub, seq) -> bool:
    it = iter(seq)
    return all(x in it for x in sub)


def test_quality_report_full_budget_matches_and_skipping_costs_fewer_layers():
    m = lively_model("tiny-llama")
    prompts = random_prompts(4, seed=2)
    examples = [
        {"input_ids": p + c, "labels": [-100] * len(p) + c}
        for p, c in zip(prompts, random_prompts(4, seed=3), strict=True)
    ]
    assert split_examples(examples) == prompts
    cfg = DecodeConfig(max_new_tokens=8)
    full = SkipOptions(min_budget=m.num_layers)  # max_budget None: all layers, so no layer is skipped
    same = skipdecode_quality(m, prompts, replace_cfg(cfg, skip=full), examples, batch_size=2)
    assert same["rouge_l"] == same["exact_match"] == 1.0
    assert same["perplexity"]["skipdecode"] == same["perplexity"]["full"]
    skip = skipdecode_quality(
        m, prompts, replace_cfg(cfg, skip=SkipOptions(max_budget=3, min_budget=2)), examples
    )
    assert skip["layers_per_token"]["skipdecode"] < skip["layers_per_token"]["full"]
    assert skip["perplexity"]["skipdecode"]["layers"] < skip["perplexity"]["full"]["layers"] == 4
    assert skip["perplexity"]["skipdecode"]["perplexity"] != skip["perplexity"]["full"]["perplexity"]


# --------------------------------------------------------------------------------------------------------
# Training module and recipe
def test_module_at_full_depth_is_the_hf_loss_and_refuses_packed_rows(tiny_llama):
    model = tiny_llama[0]
    full = SkipDecodePolicy(num_layers=4, max_budget=4, min_budget=4, max_length=64)
    ids = torch.randint(5, 261, (2, 10))
    labels = ids.clone()
    labels[:, :4] = -100
    assert response_starts(labels).tolist() == [4, 4]
    with torch.no_grad():
        ours = SkipDecodeLM(model, full)(input_ids=ids, labels=labels)["loss"]
        want = model(input_ids=ids, labels=labels).loss  # HF's forward and loss against the policy's
        torch.testing.assert_close(
            ours, want, **model_tolerance(model.config, 10, want, model.config.vocab_size + 12)
        )
    with pytest.raises(ConfigError, match="data.packing=false"):
        SkipDecodeLM(model, full)(input_ids=ids, labels=labels, attention_mask=torch.zeros(2, 1, 10, 10))
    with pytest.raises(ConfigError, match="right-padded"):
        left = torch.ones(2, 10, dtype=torch.long)
        left[0, 0] = 0
        SkipDecodeLM(model, full)(input_ids=ids, labels=labels, attention_mask=left)


def _recipe_cfg(tmp_path, *extra: str):
    data = write_chat_jsonl(tmp_path / "chat.jsonl")
    overrides = [
        "recipe=skipdecode",
        "recipe.max_budget=3",
        "recipe.min_budget=2",
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=4",
        "trainer.max_steps=2",
        "trainer.save_steps=2",
        "trainer.warmup_steps=0",
        "trainer.learning_rate=1e-3",
        f"output_dir={tmp_path / 'run'}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_recipe_trains_exports_and_reloads(tmp_path):
    summary = recipes.run(_recipe_cfg(tmp_path))
    run = tmp_path / "run"
    assert summary["export_check"]["abs_diff"] == 0  # the saved fp32 weights, reloaded: the same forward
    assert (run / "checkpoint-2").is_dir()
    options = json.loads((run / "final" / "skipdecode.json").read_text())
    assert options["decoder"] == "skipdecode" and options["skip"]["max_length"] == 512  # data.max_length
    held = summary["held_out"]
    assert held["after"]["layers"] < 4 and held["after"]["perplexity"] < held["before"]["perplexity"]
    reloaded = EarlyExitModel(AutoModelForCausalLM.from_pretrained(summary["checkpoint"]))
    cfg = DecodeConfig(max_new_tokens=6, skip=read_trained_policy(run / "final" / "skipdecode.json"))
    assert len(skipdecode(reloaded, [[3, 50, 60]], cfg).tokens[0]) == 6


def test_skipdecode_json_reads_back_the_trained_policy(tmp_path):
    """The recipe writes ``{"skip": {...}}`` with every option set, which reads back to the same policy; a
    file without that mapping (the flat ``skip_*`` keys of an unreleased format included) or with a misspelt
    key fails naming the problem."""
    policy = SkipDecodePolicy(num_layers=4, max_budget=3, min_budget=2, warmup_layers=1, max_length=40)
    path = save_trained_policy(tmp_path, policy)
    assert json.loads(path.read_text()) == {
        "decoder": "skipdecode",
        "num_layers": 4,
        "skip": {"max_budget": 3, "min_budget": 2, "warmup_layers": 1, "max_length": 40},
    }
    assert read_trained_policy(path) == SkipOptions(
        max_budget=3, min_budget=2, warmup_layers=1, max_length=40
    )
    cfg = DecodeConfig(max_new_tokens=4, skip=read_trained_policy(path))
    assert policy_from_config(cfg, 4, 3) == policy  # the policy the checkpoint was trained with
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"decoder": "skipdecode", "skip_max_budget": 3, "skip_min_budget": 2}))
    with pytest.raises(ConfigError, match=r"flat.json: no SkipDecode policy \(a 'skip' mapping\)"):
        read_trained_policy(flat)
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"skip": {"max_budgt": 3}}))
    with pytest.raises(ConfigError, match=r"typo.json: skip.max_budgt'. Did you mean 'max_budget'\?"):
        read_trained_policy(typo)


@pytest.mark.parametrize("layers,warmup", [(4, None), (30, None), (30, 4), (12, 9), (2, 0)])
def test_an_unset_option_means_the_same_when_training_and_when_decoding(layers, warmup):
    """``min_budget=None`` is half the layers (at least warmup + 1, at most max_budget), ``max_budget=None``
    all layers, ``warmup_layers=None`` one layer: the recipe config and the decoder options build one policy."""
    trained = SkipDecodeConfig(warmup_layers=warmup).training_policy(layers, 64)
    decoded = policy_from_config(
        DecodeConfig(max_new_tokens=8, skip=SkipOptions(warmup_layers=warmup, max_length=64)), layers, 5
    )
    w = 1 if warmup is None else warmup
    assert trained == decoded
    assert (decoded.max_budget, decoded.min_budget, decoded.warmup_layers) == (
        layers,
        max(w + 1, layers // 2),
        w,
    )
    capped = SkipOptions(max_budget=3, warmup_layers=0).policy(30, 64)
    assert (capped.max_budget, capped.min_budget) == (3, 3)  # half the layers, at most max_budget
    assert SkipDecodeConfig(max_budget=3, warmup_layers=0).training_policy(30, 64) == capped


def test_decoding_keeps_to_the_trained_policy():
    """Options left None take the trained values; options that match are accepted; options that contradict
    the record are refused with a named error that gives both values and the fixes."""
    trained = SkipOptions(max_budget=3, min_budget=2, warmup_layers=1, max_length=40)
    kept = dict(source="run/final/skipdecode.json", override="set skip_file=null")
    assert trained_options(trained, None, **kept) == trained
    assert trained_options(trained, SkipOptions(), **kept) == trained
    assert trained_options(trained, SkipOptions(max_budget=3, warmup_layers=1), **kept) == trained
    partial = SkipOptions(
        max_budget=3, min_budget=2, warmup_layers=1
    )  # max_length not recorded: given fills it
    assert trained_options(partial, SkipOptions(max_length=50), **kept).max_length == 50
    with pytest.raises(SkipPolicyMismatchError) as err:
        trained_options(trained, SkipOptions(min_budget=1, warmup_layers=0), **kept)
    message = str(err.value)
    assert (
        "decoder.skip.min_budget=1, trained with 2; decoder.skip.warmup_layers=0, trained with 1" in message
    )
    assert "run/final/skipdecode.json" in message and "decoder.skip.min_budget=2" in message
    assert "set skip_file=null" in message and isinstance(err.value, ConfigError)


@pytest.mark.parametrize(
    "override,message",
    [
        ("recipe.min_budget=4", r"recipe.min_budget=4 > recipe.max_budget=3"),
        ("recipe.max_budget=5", r"recipe.max_budget=5 is outside \[2, 4\]"),
        ("recipe.max_length=100", r"recipe.max_length=100 is shorter than data.max_length=512"),
        ("data.packing=true", r"data.packing=false"),
        ("+recipe.max_budgett=3", r"max_budgett"),
    ],
)
def test_bad_recipe_config_fails_before_training(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        recipes.run(_recipe_cfg(tmp_path, override))
    assert not list((tmp_path / "run").glob("checkpoint-*"))


@pytest.mark.parametrize("source", ["overrides", "trained_policy"])
def test_quality_entry_point_writes_its_report(tmp_path, source):
    from eval.skipdecode_quality import run

    data = write_chat_jsonl(tmp_path / "chat.jsonl")
    skip = ["skip.max_budget=3", "skip.min_budget=2", "skip.warmup_layers=1"]
    if source == "trained_policy":  # a recipe=skipdecode run's file: its policy, options that match it kept
        path = save_trained_policy(tmp_path, SkipDecodePolicy(4, 3, 2, 1, max_length=512))
        skip = [f"skip_file={path}", "skip.max_budget=3"]
    overrides = [
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=4",
        *skip,
        "max_new_tokens=6",
        f"output_dir={tmp_path / 'out'}",
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        report = run(compose(config_name="skipdecode_quality", overrides=overrides))
    assert report["prompts"] == 4 and 0 <= report["rouge_l"] <= 1
    assert report["layers_per_token"]["skipdecode"] < report["layers_per_token"]["full"]
    assert (
        json.loads((tmp_path / "out" / "skipdecode_quality.json").read_text())["options"]["skip"][
            "max_budget"
        ]
        == 3
    )


def test_quality_entry_point_keeps_to_the_trained_policy_before_the_model_loads(tmp_path, monkeypatch):
    """Contradicting options are refused before any load; ``skip_file=null`` decodes with them on purpose."""
    from eval.skipdecode_quality import run

    def loaded(*_, **__):
        raise RuntimeError("the model was loaded")

    monkeypatch.setattr("fastdecode.runtime.loading.load_model", loaded)
    path = save_trained_policy(tmp_path, SkipDecodePolicy(4, 3, 2, 1, max_length=512))
    base = ["model=tiny-llama", f"output_dir={tmp_path / 'out'}", "skip.min_budget=1"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        refused = compose(config_name="skipdecode_quality", overrides=[*base, f"skip_file={path}"])
        told_otherwise = compose(config_name="skipdecode_quality", overrides=[*base, "skip_file=null"])
    with pytest.raises(SkipPolicyMismatchError, match=r"skip.min_budget=1, trained with 2.*skip_file=null"):
        run(refused)
    with pytest.raises(RuntimeError, match="the model was loaded"):
        run(told_otherwise)


def test_quality_report_stops_at_a_second_eos_of_the_generation_config(tmp_path, monkeypatch):
    """Both decoders of the report stop at every EOS id the model declares (``fastdecode.tokens.eos_ids``), not
    only at the tokenizer's: each row ends at the generation config's second EOS."""
    import fastdecode.runtime.loading
    from eval.skipdecode_quality import run
    from tests.helpers import second_eos_loader

    declared: list[int] = []
    monkeypatch.setattr(
        fastdecode.runtime.loading,
        "load_model",
        second_eos_loader(fastdecode.runtime.loading.load_model, declared),
    )
    rows: dict[str, list[list[int]]] = {"skipdecode": [], "autoregressive": []}

    def spied(name: str, decode):
        def call(*args, **kwargs):
            out = decode(*args, **kwargs)
            rows[name].extend(out.tokens)
            return out

        return call

    for name in rows:
        monkeypatch.setitem(DECODERS, name, spied(name, DECODERS[name]))
    data = write_chat_jsonl(tmp_path / "chat.jsonl")
    overrides = ["model=tiny-llama", "data=jsonl", f"data.path={data}", "data.held_out=4", "max_new_tokens=6"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        run(
            compose(
                config_name="skipdecode_quality", overrides=[*overrides, f"output_dir={tmp_path / 'out'}"]
            )
        )
    assert rows["skipdecode"] == rows["autoregressive"] == [declared] * 4
