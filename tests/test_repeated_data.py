"""The repeated-task workload (fastdecode/data/repeated.py, data=repeated_records): deterministic, in a fixed
order, one fixed system block with varying records whose reference answers follow the rules; it composes as a
data config and as eval/speed.py's prompts, and no training recipe accepts it."""

from __future__ import annotations

import json

import pytest
import yaml

import recipes
from fastdecode.bench.config import plan
from fastdecode.bench.speed import read_prompt_records, tokenize_prompts
from fastdecode.config import CONFIG_DIR, ConfigError, to_dataclass
from fastdecode.data.chat import build_datasets
from fastdecode.data.config import DataConfig, check_trainable
from fastdecode.data.repeated import RECORDS, SYSTEM, repeated_records
from fastdecode.data.sources import load_records
from fastdecode.runtime.tokenizer import byte_tokenizer
from recipes.common import load_job
from recipes.preflight import preflight
from tests.job_configs import speed_cfg, train_cfg

KEYS = ["name", "email", "company", "city", "country", "phone", "role", "since"]


def workload(**override) -> DataConfig:
    raw = yaml.safe_load((CONFIG_DIR / "data" / "repeated_records.yaml").read_text())
    return to_dataclass(DataConfig, raw | override, "data")


def test_the_requests_are_deterministic_one_task_with_varying_records():
    records = repeated_records(0)
    assert records == repeated_records(0) and records != repeated_records(1)
    assert [r["id"] for r in records] == [f"repeated_records/{i:02d}" for i in range(RECORDS)]
    assert 16 <= RECORDS <= 32
    payloads = set()
    for record in records:
        system, user = record["messages"]
        assert system == {"role": "system", "content": SYSTEM} and user["role"] == "user"
        answer = json.loads(record["reference"])
        assert list(answer) == KEYS and answer["email"] == answer["email"].lower()
        assert answer["since"][4] == "-" and (answer["phone"] is None or " " not in answer["phone"])
        for key in ("name", "company", "city", "country", "role"):
            assert answer[key] in user["content"], (key, user["content"])
        day_month_year = "/".join(reversed(answer["since"].split("-")))
        assert day_month_year in user["content"]
        payloads.add(user["content"])
    assert len(payloads) == RECORDS  # every payload differs
    layouts = {
        ("\n" in r["messages"][1]["content"][8:], " | " in r["messages"][1]["content"]) for r in records
    }
    assert len(layouts) >= 3 and any(json.loads(r["reference"])["phone"] is None for r in records)


def test_the_config_composes_and_eval_speed_reads_every_request_in_order():
    cfg = workload()
    assert cfg.eval_only and cfg.source == "repeated" and cfg.name == "repeated_records"
    assert load_records(cfg) == repeated_records(0)
    assert load_records(workload(max_samples=5)) == repeated_records(0)[:5]
    assert load_records(workload(split_seed=3)) == repeated_records(3)
    base = ["model=tiny-llama", "data=repeated_records", "decoder=[autoregressive]", "hf_baseline=null"]
    base.append("max_prompt_tokens=4000")  # bytes: the system block alone is over 1,000
    job, _, _ = plan(speed_cfg(*base, "n_prompts=null"))
    records = read_prompt_records(job)
    prompts = tokenize_prompts(job, records, byte_tokenizer(), context=8192)
    assert [pid for pid, _ in prompts] == [f"repeated_records/{i:02d}" for i in range(RECORDS)]
    job, _, _ = plan(speed_cfg(*base, "n_prompts=8"))
    first = tokenize_prompts(job, read_prompt_records(job), byte_tokenizer(), context=8192)
    assert first == prompts[:8]
    tokenizer = byte_tokenizer()
    assert all(SYSTEM in tokenizer.decode(ids) for _, ids in first)  # the system block is in every prompt


@pytest.mark.parametrize("recipe", sorted(set(recipes.RECIPES) - {"cllm"}))
def test_no_training_recipe_accepts_the_workload(recipe, tmp_path):
    """CLLM is the exception by design: it trains on trajectories, its data group only feeds a report."""
    with pytest.raises(ConfigError, match="evaluation-only"):
        preflight(load_job(train_cfg(tmp_path, recipe, "data=repeated_records")))


def test_the_workload_is_refused_as_training_data():
    with pytest.raises(ConfigError, match="evaluation-only"):
        check_trainable(workload())
    with pytest.raises(ConfigError, match="evaluation-only"):
        build_datasets(workload(), byte_tokenizer())
    with pytest.raises(ConfigError, match="eval_only=true"):
        workload(eval_only=False)
