"""Exit adapters (Kangaroo): drafting through an adapter is lossless (greedy = autoregressive on every family,
several E, every policy, batch 1 and 3; sampling matches the target distribution), the base model is bitwise
untouched by training, a saved adapter drafts identically, the feature cache survives kill -9, bad input is a
named error before any work."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adapter_train.config import ExitAdapterConfig, LossConfig
from adapter_train.module import AdapterLM
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.policies import POLICIES
from fastdecode.drafters.exits.adapter import (
    KINDS,
    AdapterMismatchError,
    DraftVocabMismatchError,
    ExitLayerError,
    build_adapter,
    load_adapter,
    save_adapter,
)
from fastdecode.files.draft_vocab_file import save_draft_vocab
from fastdecode.files.tensor_shards import ShardHeaderError, ShardReader, ShardWriter
from fastdecode.registry import DECODERS
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training.feature_config import FeatureConfig
from fastdecode.training.feature_records import batch_features
from fastdecode.training.features import FeatureDataset, build_features, collate_features
from tests.conftest import TINY_MODELS
from tests.helpers import (
    assert_drafted_and_accepted,
    exact_joint,
    lively_model,
    pair_pvalues,
    perturbed_adapter,
    random_examples,
    random_prompts,
    tiny_llama_adapter,
    tiny_model,
    tiny_vocab_model,
)
from tests.job_configs import tiny_speed_cfg

ROOT = Path(__file__).resolve().parents[1]
autoregressive = DECODERS["autoregressive"]
self_speculative = DECODERS["self_speculative"]


def _saved(tmp_path: Path, m: EarlyExitModel, adapter, name: str, vocab=None) -> str:
    return str(save_adapter(adapter, tmp_path / name, m, vocab=vocab))


# --------------------------------------------------------------------------------------------------------
# Lossless decoding through an adapter
@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_through_an_adapter_equals_autoregressive(name, kind, tmp_path):
    """Every E in [1, L-1], every policy, batch 3 (ragged acceptance, holes) and batch 1; sliding-window
    families check the adapter's own cache layer across holes."""
    m = lively_model(name, 0.1)
    prompts = random_prompts(3, seed=TINY_MODELS.index(name) + 20)
    base = DecodeConfig(max_new_tokens=20, draft_tokens=4, eos_token_id=m.config.eos_token_id)
    ref = autoregressive(m, prompts, base).tokens
    rates = []
    for exit_layer in range(1, m.num_layers):
        path = _saved(tmp_path, m, perturbed_adapter(m, exit_layer, kind, seed=exit_layer), f"E{exit_layer}")
        for policy in POLICIES:
            cfg = replace(base, adapter=path, policy=policy)
            out = self_speculative(m, prompts, cfg)
            assert out.tokens == ref, (exit_layer, policy)
            assert self_speculative(m, prompts[1:2], cfg).tokens == ref[1:2], (exit_layer, policy)
            assert out.oracle == out.accepted
            rates.append(out.acceptance_rate)
    assert min(rates) > 0.05 and max(rates) < 1  # drafts were accepted and rejected: rollback exercised


def test_greedy_through_an_adapter_with_a_draft_vocabulary_and_many_rows(tmp_path):
    m = lively_model("tiny-mistral", 0.1)
    prompts = random_prompts(8, seed=31)
    vocab = torch.arange(3, 200)  # EOS (4) inside; tokens >= 200 are never drafted
    path = _saved(tmp_path, m, perturbed_adapter(m, 2, "block"), "E2", vocab=vocab)
    base = DecodeConfig(max_new_tokens=24, eos_token_id=m.config.eos_token_id)
    ref = autoregressive(m, prompts, base).tokens
    for policy in POLICIES:
        out = self_speculative(m, prompts, replace(base, adapter=path, policy=policy, draft_tokens=6))
        assert out.tokens == ref and 0 < out.acceptance_rate < 1


def test_the_adapter_cache_layer_is_filled_and_rolled_back_with_the_rest(tmp_path):
    m = lively_model("tiny-llama", 0.1)
    path = _saved(tmp_path, m, perturbed_adapter(m, 2, "attention"), "E2")
    from fastdecode.drafters.exits import proposer as module

    captured, original = {}, module.prefill

    def spy(*args, **kwargs):
        captured["state"] = state = original(*args, **kwargs)
        return state

    module.prefill = spy
    try:
        self_speculative(m, random_prompts(3, seed=9), DecodeConfig(max_new_tokens=15, adapter=path))
    finally:
        module.prefill = original
    cache = captured["state"].cache
    assert len(cache.lengths) == m.num_layers + 1  # one extra slot: the adapter's
    # The adapter's layer never runs ahead of the model's, and lags by at most the backlog of one round.
    assert cache.lengths[0] - 8 <= cache.lengths[-1] <= cache.lengths[0]
    assert len(set(cache.lengths[:-1])) == 1


@pytest.mark.parametrize("policy", ["constant", "adaptive"])
def test_sampling_through_an_adapter_matches_the_target_distribution(policy, tmp_path):
    """As ``test_speculative_sampling_matches_the_target_distribution``: 4000 rows, every adjacent pair of the
    4 new tokens matches the target's exactly computed joint distribution."""
    m = tiny_vocab_model()
    path = _saved(tmp_path, m, perturbed_adapter(m, 1, "block", std=0.1), "E1")
    prompt, samples = [3, 1, 4, 1, 5], 4000
    cfg = DecodeConfig(max_new_tokens=4, temperature=1.0, draft_tokens=3, seed=1, policy=policy, adapter=path)
    joint = exact_joint(m, prompt, 4, cfg)
    out = self_speculative(m, [prompt] * samples, cfg)
    assert 0.2 < out.acceptance_rate < 0.95
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3


# --------------------------------------------------------------------------------------------------------
# Save / load
def test_a_saved_and_loaded_adapter_gives_identical_drafts(tmp_path):
    m = lively_model("tiny-qwen2", 0.1)
    adapter = perturbed_adapter(m, 2, "block", seed=3).eval()
    first = _saved(tmp_path, m, adapter, "a")
    loaded, meta, ids = load_adapter(first, m)
    assert meta["exit_layer"] == 2 and meta["kind"] == "block" and ids is None
    assert meta["base"]["hidden_size"] == m.config.hidden_size and meta["base"]["fingerprint"]
    hidden = torch.randn(2, 7, m.config.hidden_size)
    positions = torch.arange(7).expand(2, -1)
    with torch.no_grad():
        assert torch.equal(adapter(m, hidden, positions), loaded(m, hidden, positions))
    second = _saved(tmp_path, m, loaded, "b")
    prompts = random_prompts(3, seed=4)
    cfg = DecodeConfig(max_new_tokens=16, draft_tokens=3)
    a = self_speculative(m, prompts, replace(cfg, adapter=first))
    b = self_speculative(m, prompts, replace(cfg, adapter=second))
    assert a.accepted == b.accepted and a.oracle == b.oracle and a.tokens == b.tokens
    assert_drafted_and_accepted(a)


def test_an_adapter_saved_again_into_the_same_directory_is_loaded_again(tmp_path):
    """Decoding loads an adapter once per model and version of its files (fastdecode/files/file_cache.py)."""
    from fastdecode.drafters.exits.adapter import adapter_for_decoding

    m = lively_model("tiny-llama", 0.1)
    path = _saved(tmp_path, m, perturbed_adapter(m, 2, "block", seed=1), "E")
    cfg = DecodeConfig(max_new_tokens=4, adapter=path)
    first, _ = adapter_for_decoding(cfg, m)
    assert adapter_for_decoding(cfg, m)[0] is first  # the same files: the same module
    _saved(tmp_path, m, perturbed_adapter(m, 3, "attention", seed=2), "E")  # trained again, same place
    second, _ = adapter_for_decoding(cfg, m)
    assert second is not first and (second.exit_layer, second.kind) == (3, "attention")


# --------------------------------------------------------------------------------------------------------
# Training leaves the base model untouched


def test_training_changes_the_adapter_and_not_a_bit_of_the_base_model():
    model = copy.deepcopy(tiny_model("tiny-llama")[0])
    m = EarlyExitModel(model)
    model.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    records = batch_features(m, random_examples(), [1, 3], 8, torch.float32)
    adapters = {1: build_adapter(m, 1, "block"), 3: build_adapter(m, 3, "attention")}
    start = {k: v.clone() for k, v in adapters[1].state_dict().items()}
    for target in ("topk", "full"):
        module = AdapterLM(m, adapters, LossConfig(target=target, ce_weight=0.5), torch.arange(0, 200))
        fields = ["scored", "targets", "teacher", "h1", "h3", "topk_ids", "topk_logp", "final"]
        batch = collate_features([{k: r[k] for k in fields} for r in records], [1, 3])
        optim = torch.optim.AdamW(module.parameters(), lr=1e-2)
        assert {n.split(".")[0] for n, _ in module.named_parameters()} == {"adapters"}
        for _ in range(3):
            loss = module(**batch)["loss"]
            loss.backward()
            optim.step()
            optim.zero_grad()
        assert torch.isfinite(loss)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert any(not torch.equal(v, start[k]) for k, v in adapters[1].state_dict().items())
    assert set(module.state_dict()) == {f"adapters.{k}" for k in module.adapters.state_dict()}


# --------------------------------------------------------------------------------------------------------
# Feature cache: crash safety
_KILL_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from fastdecode.training.feature_config import FeatureConfig
    from fastdecode.training.features import build_features
    from fastdecode.config import ModelConfig, load_group
    from fastdecode.runtime.loading import load_model
    from fastdecode.runtime.model import EarlyExitModel
    from tests.helpers import random_examples

    model, tokenizer = load_model(load_group("model", "tiny-llama", ModelConfig, dtype="float32", device="cpu"))
    fcfg = FeatureConfig(batch_size=2, shard_records=2, top_k=4, dtype="float32")

    def committed(n):
        print("COMMIT", n, flush=True)
        time.sleep(float(sys.argv[2]))

    build_features(EarlyExitModel(model), tokenizer, random_examples(12), sys.argv[1], fcfg, exits=[1, 2], data="synthetic",
                   on_commit=committed)
    print("DONE", flush=True)
    """
)


def _run_builder(directory: Path, script: Path, pause: float) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, str(script), str(directory), str(pause)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=str(ROOT),
    )


def _records(directory: Path) -> list[dict]:
    return list(ShardReader(directory))


def test_feature_caching_resumes_after_kill_9_without_losing_or_duplicating(tmp_path):
    script = tmp_path / "build.py"
    script.write_text(_KILL_SCRIPT)
    killed = tmp_path / "killed"
    proc = _run_builder(killed, script, 0.05)
    commits = 0
    while commits < 2:  # kill -9 while it is writing the next shards
        line = proc.stdout.readline()
        assert line, "the builder ended before it was killed"
        commits += line.startswith("COMMIT")
    time.sleep(0.03)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = json.loads((killed / "manifest.json").read_text())
    assert not partial["complete"] and 2 <= partial["records"] // 2 < 6
    resumed = _run_builder(killed, script, 0.0)
    assert "DONE" in resumed.communicate(timeout=300)[0]
    clean = tmp_path / "clean"  # the same build, uninterrupted, in this process
    model, tokenizer = tiny_model("tiny-llama")
    fcfg = FeatureConfig(batch_size=2, shard_records=2, top_k=4, dtype="float32")
    build_features(
        EarlyExitModel(model), tokenizer, random_examples(12), clean, fcfg, exits=[1, 2], data="synthetic"
    )
    got, want = _records(killed), _records(clean)
    assert sorted(int(r["index"]) for r in got) == list(range(12))  # every record exactly once
    assert len(got) == len(want) == 12
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not [p for p in killed.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_a_crash_between_shard_and_manifest_commits_nothing_twice(tmp_path, monkeypatch):
    import fastdecode.files.tensor_shards as shards

    header = {"model": "x"}
    writer = ShardWriter(tmp_path, header, shard_records=2)
    for i in range(2):
        writer.add({"index": torch.tensor([i])})
    calls = {"n": 0}
    original = shards.atomic_write_json

    def crash(*args, **kwargs):
        calls["n"] += 1
        raise KeyboardInterrupt  # the shard file is in place, its manifest entry is not

    monkeypatch.setattr(shards, "atomic_write_json", crash)
    writer.add({"index": torch.tensor([2])})
    with pytest.raises(KeyboardInterrupt):
        writer.add({"index": torch.tensor([3])})
    monkeypatch.setattr(shards, "atomic_write_json", original)
    resumed = ShardWriter(tmp_path, header, shard_records=2)
    assert resumed.records == 2 and len(list(tmp_path.glob("shard-*"))) == 1  # the orphan shard is gone
    for i in range(resumed.records, 5):
        resumed.add({"index": torch.tensor([i])})
    resumed.finish()
    assert [int(r["index"]) for r in ShardReader(tmp_path)] == [0, 1, 2, 3, 4]
    with pytest.raises(ShardHeaderError, match="model"):
        ShardWriter(tmp_path, {"model": "y"}, shard_records=2)


# --------------------------------------------------------------------------------------------------------
# Named errors before any work
def test_exit_layer_outside_the_model_is_refused():
    m = lively_model("tiny-llama")
    for bad in (0, m.num_layers, -1):
        with pytest.raises(ExitLayerError, match=r"in \[1, 3\]"):
            build_adapter(m, bad)
    cfg = ExitAdapterConfig(exits=[2, 4])
    with pytest.raises(ExitLayerError, match=r"recipe.exits=4.*\[1, 3\]"):
        cfg.validate(m.num_layers)
    with pytest.raises(ExitLayerError, match="recipe.features.exits=0"):
        ExitAdapterConfig(exits=[2], features=FeatureConfig(exits=[0, 2])).validate(m.num_layers)


def test_decoding_refuses_another_exit_and_another_model(tmp_path):
    m = lively_model("tiny-llama", 0.1)
    path = _saved(tmp_path, m, perturbed_adapter(m, 2, "block"), "E2")
    with pytest.raises(ExitLayerError, match="exit_layer=3 but the adapter.*E=2"):
        self_speculative(m, [[5, 6]], DecodeConfig(max_new_tokens=4, adapter=path, exit_layer=3))
    other = EarlyExitModel(tiny_model("tiny-llama")[0])  # same family and geometry, other weights
    with pytest.raises(AdapterMismatchError, match="fingerprint"):
        self_speculative(other, [[5, 6]], DecodeConfig(max_new_tokens=4, adapter=path))
    config = LlamaConfig(
        vocab_size=261,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    narrow = EarlyExitModel(LlamaForCausalLM(config).eval())
    with pytest.raises(AdapterMismatchError, match="hidden_size: 64 there, 32 here"):
        load_adapter(path, narrow)

    class OtherTokenizer:
        name_or_path = "other"

        def get_vocab(self):
            return {"a": 0, "b": 1}

    tokenizer = tiny_model("tiny-llama")[1]
    save_adapter(perturbed_adapter(m, 2, "block"), tmp_path / "with-tok", m, tokenizer)
    load_adapter(tmp_path / "with-tok", m, tokenizer)
    with pytest.raises(AdapterMismatchError, match="tokenizer.vocab_hash"):
        load_adapter(tmp_path / "with-tok", m, OtherTokenizer())


def test_a_draft_vocabulary_that_does_not_match_is_refused(tmp_path):
    m = lively_model("tiny-llama", 0.1)
    trained = _saved(tmp_path, m, perturbed_adapter(m, 2, "block"), "vocab", vocab=torch.arange(3, 100))
    full = _saved(tmp_path, m, perturbed_adapter(m, 2, "block"), "full")
    other = save_draft_vocab(tmp_path / "other.json", torch.arange(3, 50), vocab_size=m.vocab_size)
    cfg = DecodeConfig(max_new_tokens=4, draft_vocab=str(other))
    with pytest.raises(DraftVocabMismatchError, match="97-token draft vocabulary"):
        self_speculative(m, [[5, 6]], replace(cfg, adapter=trained))
    with pytest.raises(DraftVocabMismatchError, match="the full LM head"):
        self_speculative(m, [[5, 6]], replace(cfg, adapter=full))
    # The adapter's own vocabulary is used when none is given, and may be named explicitly.
    own = str(Path(trained) / "draft_vocab.json")
    assert self_speculative(m, [[5, 6]], DecodeConfig(max_new_tokens=4, adapter=trained, draft_vocab=own))
    # A vocabulary file edited after training no longer matches the adapter's record of it.
    save_draft_vocab(own, torch.arange(3, 90), vocab_size=m.vocab_size)
    with pytest.raises(DraftVocabMismatchError, match="changed since training"):
        load_adapter(trained, m)


def test_a_feature_cache_of_another_model_tokenizer_or_setting_is_refused(tmp_path):
    model, tokenizer = tiny_model("tiny-llama")
    m = EarlyExitModel(model)
    fcfg = FeatureConfig(batch_size=2, shard_records=2, top_k=4, dtype="float32")
    reader = build_features(m, tokenizer, random_examples(4), tmp_path, fcfg, exits=[1, 2], data="synthetic")
    assert len(reader) == 4 and len(FeatureDataset(reader, [2], "topk")) == 4
    assert (
        len(build_features(m, tokenizer, random_examples(4), tmp_path, fcfg, exits=[2], data="synthetic"))
        == 4
    )  # reused
    other = lively_model("tiny-llama")
    with pytest.raises(AdapterMismatchError, match="feature cache.*fingerprint"):
        build_features(other, tokenizer, random_examples(4), tmp_path, fcfg, exits=[1, 2], data="synthetic")

    class OtherTokenizer:
        name_or_path = "other"

        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(AdapterMismatchError, match="tokenizer"):
        build_features(
            m, OtherTokenizer(), random_examples(4), tmp_path, fcfg, exits=[1, 2], data="synthetic"
        )
    with pytest.raises(ShardHeaderError, match="top_k"):
        build_features(
            m, tokenizer, random_examples(4), tmp_path, replace(fcfg, top_k=8), exits=[1, 2], data="synthetic"
        )
    with pytest.raises(ShardHeaderError, match="not \\[3\\]"):
        build_features(m, tokenizer, random_examples(4), tmp_path, fcfg, exits=[1, 3], data="synthetic")
    qwen = EarlyExitModel(tiny_model("tiny-qwen2")[0])
    with pytest.raises(AdapterMismatchError, match="model_type: 'llama' there, 'qwen2' here"):
        build_features(qwen, tokenizer, random_examples(4), tmp_path, fcfg, exits=[1, 2], data="synthetic")


# --------------------------------------------------------------------------------------------------------
# The speed benchmark and the per-exit report
def test_the_speed_benchmark_runs_self_speculation_through_an_adapter(tmp_path):
    from eval.speed import run

    path = tiny_llama_adapter(tmp_path, 3, "attention")
    cfg = tiny_speed_cfg(
        tmp_path,
        "decoder=[autoregressive,self_speculative_adapter,self_speculative_adapter_constant]",
        f"adapter={path}",
        "hf_baseline=null",
        "repeats=1",
        "batch_sizes=[1,2]",
    )
    result = run(cfg)
    rows = [r for r in result["summary"] if "adapter" in r["method"]]
    assert len(rows) == 4 and all(r["match_rate"] == 1.0 and r["exit_layer"] == 3 for r in rows)
    assert all(r["acceptance_rate"] is not None for r in rows)
    assert result["methods"]["self_speculative_adapter"]["options"]["adapter"] == path
    with pytest.raises(Exception, match="drafts through an exit adapter and none is set"):
        run(tiny_speed_cfg(tmp_path, "decoder=[autoregressive,self_speculative_adapter]", "hf_baseline=null"))


@pytest.mark.parametrize(
    "index,message",
    [
        ("{not json", r"adapters.json is not a run's adapter index"),
        ('{"chosen": 1}', r"adapters.json is not a run's adapter index"),
        ('{"adapters": ["E1"]}', r"adapters.json is not a run's adapter index"),
        ('{"adapters": {"1": "E1", "2": "E2"}}', r"use different draft vocabularies.*adapter=.*/E<exit>"),
    ],
)
def test_the_exit_report_refuses_a_bad_run_of_adapters_before_loading(tmp_path, monkeypatch, index, message):
    """``eval/exits.py adapter=<run>``: an index without ``adapters`` (was a KeyError) or adapters of
    different draft vocabularies (was a ValueError after the model loaded) are named errors, before any load."""
    from hydra import compose, initialize_config_dir

    from fastdecode.config import CONFIG_DIR
    from fastdecode.drafters.exits.adapter import AdapterError
    from fastdecode_cli.exits import run

    model, tokenizer = tiny_model("tiny-llama")
    m = EarlyExitModel(model)
    run_dir = tmp_path / "run"
    save_adapter(perturbed_adapter(m, 1, "block"), run_dir / "E1", m, tokenizer, vocab=torch.arange(3, 100))
    save_adapter(perturbed_adapter(m, 2, "block"), run_dir / "E2", m, tokenizer)
    (run_dir / "adapters.json").write_text(index)
    monkeypatch.setattr(
        "fastdecode.runtime.loading.load_model", lambda *a, **k: pytest.fail("a model was loaded")
    )
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("exits", overrides=["model=tiny-llama", f"adapter={run_dir}", f"output_dir={tmp_path}"])
    with pytest.raises(AdapterError, match=message):
        run(cfg)


def test_the_exit_report_compares_raw_exits_with_adapters(tmp_path):
    from fastdecode.reports.exits import adapter_generation_report

    m = lively_model("tiny-llama", 0.1)
    adapters = {e: perturbed_adapter(m, e, "block", seed=e, std=0.02).eval() for e in (1, 3)}
    generations = [(p + [7, 8, 9, 10, 11], len(p)) for p in random_prompts(3, seed=5)]
    report = adapter_generation_report(m, adapters, generations, torch.arange(0, 200))
    assert set(report["raw"]) == set(report["adapter"]) == {1, 3} and report["tokens"] == 15
    assert all(0 <= v <= 1 for v in [*report["raw"].values(), *report["adapter"].values()])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_a_zero_initialised_block_starts_as_the_raw_exit(name):
    m = lively_model(name, 0.1)
    adapter = build_adapter(m, 2, "block", "last", zero_residual=True)
    hidden = torch.randn(2, 5, m.config.hidden_size)
    with torch.no_grad():
        out = adapter(m, hidden, torch.arange(5).expand(2, -1))
    assert torch.equal(out, hidden)
    assert all(p.requires_grad for p in adapter.parameters())
