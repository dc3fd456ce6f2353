"""Trajectory collection: fixed points equal greedy decoding, records follow the schema, a killed run resumes
to exactly the records of an uninterrupted one, two processes split the prompts, bad input fails clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from cllm_train.collect import run
from cllm_train.records import RecordError, check_manifest, iter_records, read_manifest
from eval.collect_throughput import run as run_throughput
from fastdecode.config import ConfigError, ModelConfig, load_group
from fastdecode.decoding.config import DecodeConfig
from fastdecode.registry import DECODERS
from fastdecode.runtime.loading import load_model
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.runtime.tokenizer import byte_tokenizer
from tests.helpers import free_port, second_eos_loader
from tests.job_configs import collect_cfg, collect_overrides

ROOT = Path(__file__).resolve().parents[1]


def _records(directory: Path) -> list[dict]:
    return list(iter_records(directory))


def test_fixed_points_are_greedy_and_records_chain(tmp_path):
    cfg = collect_cfg(tmp_path)
    manifest = run(cfg)
    records = _records(tmp_path / "out")
    assert manifest["complete"] and len(records) == manifest["totals"]["records"] > 12
    assert len(manifest["shards"]) > 1 and sorted(manifest["completed_prompt_ids"]) == sorted(
        {r["prompt_id"] for r in records}
    )
    init = load_group("model", "tiny-llama", ModelConfig).random_init | {"initializer_range": 0.2}
    hf, tokenizer = load_model(load_group("model", "tiny-llama", ModelConfig, random_init=init))
    m = EarlyExitModel(hf)
    greedy = DECODERS["autoregressive"](m, [r["prefix"] for r in records], DecodeConfig(max_new_tokens=6))
    for rec, tokens in zip(records, greedy.tokens, strict=True):
        assert rec["fixed_point"] == tokens  # the fixed point is the greedy continuation of the prefix
    by_prompt: dict[str, list[dict]] = {}
    for rec in records:
        by_prompt.setdefault(rec["prompt_id"], []).append(rec)
    for recs in by_prompt.values():
        assert [r["block"] for r in recs] == list(range(len(recs)))
        for a, b in zip(recs, recs[1:], strict=False):
            assert b["prefix"] == a["prefix"] + a["fixed_point"] and not a["eos"]
        last = recs[-1]
        assert last["eos"] or len(last["prefix"]) + 6 - last["prompt_len"] >= 20
        assert last["labels"] == recs[0]["labels"] and last["labels"][-1] == tokenizer.eos_token_id
    check_manifest(manifest, tokenizer, "random:tiny-llama:0")


def test_a_second_eos_of_the_generation_config_ends_each_trajectory(tmp_path, monkeypatch):
    """The model's generation config declares a second EOS id: a fixed point holding it is marked ``eos`` and
    is its prompt's last record (``fastdecode.tokens.eos_ids``; the tokenizer's EOS alone would collect on to
    max_new_seq_len=20, four blocks of 6)."""
    import cllm_train.collect

    declared: list[int] = []
    monkeypatch.setattr(
        cllm_train.collect, "load_model", second_eos_loader(cllm_train.collect.load_model, declared)
    )
    manifest = run(collect_cfg(tmp_path, lively=False))  # the default init: the same token over and over
    by_prompt: dict[str, list[dict]] = {}
    for rec in _records(tmp_path / "out"):
        by_prompt.setdefault(rec["prompt_id"], []).append(rec)
    assert manifest["complete"] and len(by_prompt) == manifest["totals"]["prompts"] > 1
    for recs in by_prompt.values():
        assert len(recs) == 1 and recs[0]["eos"] and declared[0] in recs[0]["fixed_point"]


def test_killed_collection_resumes_to_the_uninterrupted_records(tmp_path):
    whole = tmp_path / "whole"
    whole.mkdir()
    run(collect_cfg(whole))
    expected = _records(whole / "out")

    class Killed(Exception):
        pass

    def kill_after_two(k: int) -> None:
        if k == 2:
            raise Killed

    with pytest.raises(Killed):
        run(collect_cfg(tmp_path), after_commit=kill_after_two)
    partial = read_manifest(tmp_path / "out")
    assert not partial["complete"] and partial["totals"]["prompts"] == 6
    shard = tmp_path / "out" / partial["shards"][-1]["path"]
    with open(shard, "a") as f:  # a batch that was being written when the process died
        f.write('{"prompt_id": "chat.jsonl:9", "block": 0, "pre')
    manifest = run(collect_cfg(tmp_path))
    assert _records(tmp_path / "out") == expected
    assert manifest["totals"] == read_manifest(whole / "out")["totals"]
    with pytest.raises(ConfigError, match="config.block_size"):  # a resume must not mix two collections
        run(collect_cfg(tmp_path, "block_size=7"))


def test_repetition_filters_are_counted_and_an_empty_result_is_an_error(tmp_path):
    manifest = run(collect_cfg(tmp_path, "filters.ngram_size=1", "filters.max_ngram_repeats=1"))
    records = _records(tmp_path / "out")
    assert 0 < manifest["filters"]["repeat_ngram"] < manifest["totals"]["prompts"] and records
    for rec in records:  # kept blocks never repeat a token (cut at EOS)
        output = rec["prefix"][rec["prompt_len"] :] + rec["fixed_point"]
        output = output[: output.index(4) + 1] if 4 in output else output
        assert len(set(output)) == len(output)
    # the default tiny init repeats one token: every prompt stops at its first block, nothing is left
    with pytest.raises(ConfigError, match="filtered out"):
        run(
            collect_cfg(tmp_path, "filters.max_repeat_run=3", f"output_dir={tmp_path / 'none'}", lively=False)
        )
    assert read_manifest(tmp_path / "none")["filters"]["repeat_run"] == 12


def test_bad_input_fails_clearly(tmp_path):
    with pytest.raises(ConfigError, match="n >= 2"):
        run(collect_cfg(tmp_path, "block_size=1"))
    with pytest.raises(ConfigError, match="evaluation-only"):
        run(collect_cfg(tmp_path, "data=mt_bench"))
    with pytest.raises(ConfigError, match="no prompt to collect"):
        run(collect_cfg(tmp_path, "max_prompt_len=3"))
    assert not (tmp_path / "out").exists()  # refused before any work
    run(collect_cfg(tmp_path, "max_prompts=3"))
    manifest = read_manifest(tmp_path / "out")
    with pytest.raises(ConfigError, match="model 'random:tiny-llama:0'"):
        check_manifest(manifest, byte_tokenizer(), "HuggingFaceTB/SmolLM2-135M-Instruct")
    other = byte_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(ConfigError, match="tokenizer"):
        check_manifest(manifest, other, "random:tiny-llama:0")
    shard = tmp_path / "out" / manifest["shards"][0]["path"]
    lines = shard.read_text().splitlines(keepends=True)
    broken = json.loads(lines[1]) | {"first_mismatch": [0]}
    shard.write_text(lines[0] + json.dumps(broken) + "\n" + "".join(lines[2:]))
    manifest["shards"][0]["bytes"] = shard.stat().st_size
    with pytest.raises(RecordError, match=f"{shard.name}:2: .*first_mismatch"):
        list(iter_records(tmp_path / "out", manifest))


def test_throughput_benchmark_matches_the_reference(tmp_path):
    report = run_throughput(collect_cfg(tmp_path, "+bench_prompts=3", "+warmup=true", "max_new_seq_len=12"))
    assert report["records"]["ours"] == report["records"]["reference"] == report["same_states"] > 0
    from fastdecode.runtime.machine import machine_label

    assert report["measured_on"] == machine_label()  # tokens per second name the CPU and its threads


@pytest.mark.distributed
def test_two_processes_split_the_prompts(tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    run(collect_cfg(single))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = launcher + [str(free_port()), "collect_jacobi.py", *collect_overrides(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = read_manifest(tmp_path / "out")
    assert manifest["complete"] and manifest["world_size"] == 2
    assert {s["path"].split("-")[1] for s in manifest["shards"]} == {"r0", "r1"}
    key = lambda r: (r["prompt_id"], r["block"])  # noqa: E731
    assert sorted(_records(tmp_path / "out"), key=key) == sorted(_records(single / "out"), key=key)


@pytest.mark.slow
def test_smollm2_sharegpt_fixed_points_are_greedy(tmp_path):
    out = tmp_path / "out"
    overrides = [
        "model=smollm2-135m",
        "model.dtype=float32",
        "model.device=cpu",
        "data=sharegpt",
        "max_prompts=3",
        "block_size=16",
        "max_new_seq_len=32",
        "progress=false",
        f"output_dir={out}",
    ]
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        run(compose("collect_jacobi", overrides=overrides))
    records = _records(out)
    hf, _ = load_model(load_group("model", "smollm2-135m", ModelConfig, dtype="float32", device="cpu"))
    # the trajectories are the fp32 model's (the model CLLM trains), not the GGUF's 4-bit path decoding's
    fp32 = DecodeConfig(16, weights="fp32")
    greedy = DECODERS["autoregressive"](EarlyExitModel(hf), [r["prefix"] for r in records], fp32)
    assert [r["fixed_point"] for r in records] == greedy.tokens
