"""Prompt lookup's semantics (fastdecode/drafters/lookup/ngram.py's NgramIndex: the most recent or the earliest
occurrence, where EOS cuts) against a brute-force search, and the replay that chose them
(fastdecode/bench/lookup_replay.py): its rounds are the ``prompt_lookup`` decoder's, round for round."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir

from fastdecode.bench.lookup_replay import Variant, replay
from fastdecode.config import CONFIG_DIR, ConfigError
from fastdecode.decoding.config import DecodeConfig
from fastdecode.drafters.lookup.ngram import NgramIndex
from fastdecode.drafters.lookup.options import LookupOptions
from fastdecode.plan.cost import CostModel
from fastdecode.registry import DECODERS
from fastdecode.runtime.model import EarlyExitModel
from fastdecode_cli.lookup_replay import run
from tests.helpers import lively_model, random_prompts, tiny_model, write_chat_jsonl

autoregressive = DECODERS["autoregressive"]


def brute_force(tokens, max_n, min_n, limit, *, match, stop, eos):
    """What a lookup must return, by scanning every earlier occurrence of every suffix."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        starts = [s for s in range(end - n) if tokens[s : s + n] == tokens[end - n :]]
        if starts:
            start = starts[-1] if match == "recent" else starts[0]
            found = tokens[start + n : start + n + limit]
            cuts = [i for i, t in enumerate(found) if t in stop]
            if cuts:
                found = found[: cuts[0] + (eos == "after")]
            return found, n
    return [], 0


@pytest.mark.parametrize("eos", ["before", "after"])
@pytest.mark.parametrize("match", ["recent", "earliest"])
def test_the_index_finds_what_a_brute_force_search_finds(match, eos):
    """60 random token streams over a small alphabet (many repeats), fed in random chunks; after each chunk
    every (min n, limit) lookup equals the scan's, with EOS ids among the tokens."""
    looked_up = 0
    for seed in range(60):
        rng = random.Random(seed)
        stop = {0} if seed % 3 else set()
        max_n = rng.randint(1, 4)
        index = NgramIndex(max_n, match=match, stop=stop, eos=eos)
        tokens = []
        while len(tokens) < 80:
            chunk = [rng.randrange(rng.choice([3, 5, 8])) for _ in range(rng.randint(1, 4))]
            index.extend(chunk)
            tokens += chunk
            assert index.tokens == tokens
            for min_n in range(1, max_n + 1):
                for limit in (1, 3, 7):
                    expected = brute_force(tokens, max_n, min_n, limit, match=match, stop=stop, eos=eos)
                    assert index.lookup(min_n, limit) == expected, (seed, tokens, min_n, limit)
                    looked_up += bool(expected[0])
    assert looked_up > 1000


def test_eos_is_cut_before_or_after_never_past():
    eos = 99
    before = NgramIndex(2, match="earliest", stop={eos})
    after = NgramIndex(2, match="earliest", stop={eos}, eos="after")
    for index in (before, after):
        index.extend([1, 2, 3, eos, 4, 1, 2])
    assert before.lookup(1, 5) == ([3], 2) and after.lookup(1, 5) == ([3, eos], 2)
    recent = NgramIndex(2, stop={eos})
    recent_after = NgramIndex(2, stop={eos}, eos="after")
    for index in (recent, recent_after):
        index.extend([5, 6, 9, 8, 5, 6, eos, 1, 5, 6])
    # The most recent (5, 6) is followed by EOS: "before" drafts nothing, "after" the EOS alone.
    assert recent.lookup(1, 3) == ([], 2) and recent_after.lookup(1, 3) == ([eos], 2)
    earliest = NgramIndex(2, stop={eos}, match="earliest")
    earliest.extend([5, 6, 9, 8, 5, 6, eos, 1, 5, 6])
    assert earliest.lookup(1, 3) == ([9, 8, 5], 2)
    with pytest.raises(ConfigError, match="Unknown lookup match 'latest'.*earliest, recent"):
        LookupOptions(match="latest")
    with pytest.raises(ConfigError, match="Unknown lookup eos 'never'"):
        LookupOptions(eos="never")


# --------------------------------------------------------------------------------------------------------
# The replay is the decoder, round for round
CPU_LIKE = CostModel(
    4, 261, (1, 2, 3, 4, 6), (0.2, 0.23, 0.25, 0.27, 0.3), (0.2, 0.21, 0.22, 0.23, 0.25), "measured"
)


@pytest.mark.parametrize("variant", [Variant("recent", 3, "before"), Variant("earliest", 2, "after")])
@pytest.mark.parametrize("policy", ["constant", "adaptive", "heuristic"])
def test_the_replay_drafts_accepts_and_rounds_as_the_decoder(policy, variant, monkeypatch):
    """The decoder and the replay share one cost model object (so the adaptive cut is the same); prompts that
    repeat themselves, answers with an EOS in them; alone and as a batch (answers
    twice the budget: a row may draft up to the longest row's remaining tokens)."""
    monkeypatch.setattr("fastdecode.decoding.kinds.cost_model", lambda m, source, batch=1: CPU_LIKE)
    total = 0
    for m in (EarlyExitModel(tiny_model("tiny-llama")[0]), lively_model("tiny-llama", 0.1)):
        prompts = [p + p[:5] + p for p in random_prompts(5, seed=70)]
        eos = autoregressive(m, prompts[:1], DecodeConfig(max_new_tokens=8)).tokens[0][6]
        cfg = variant.config(DecodeConfig(max_new_tokens=24, draft_tokens=4, policy=policy, eos_token_id=eos))
        answers = autoregressive(m, prompts, replace(cfg, max_new_tokens=48)).tokens
        for prompt, answer in zip(prompts, answers, strict=True):
            real = DECODERS["prompt_lookup"](m, [prompt], cfg)
            found = replay([prompt], [answer], cfg, CPU_LIKE, vocab_size=m.vocab_size)
            assert found.out.tokens == real.tokens
            assert (found.out.accepted, found.out.drafted) == (real.accepted, real.drafted)
            assert found.out.steps == real.steps and found.out.by_proposer == real.by_proposer
            assert found.cost == pytest.approx(sum(CPU_LIKE.round_cost(d, 0.0) for d in real.drafted))
            total += sum(real.accepted)
        real = DECODERS["prompt_lookup"](m, prompts, cfg)
        found = replay(prompts, answers, cfg, CPU_LIKE, vocab_size=m.vocab_size).out
        assert (found.tokens, found.accepted, found.drafted, found.steps) == (
            real.tokens,
            real.accepted,
            real.drafted,
            real.steps,
        )
    assert total > 20  # drafts were accepted: the comparison saw the decoder's rounds, not plain steps


def test_the_replay_refuses_answers_it_cannot_judge():
    m = lively_model("tiny-llama", 0.1)
    cfg = DecodeConfig(max_new_tokens=10, eos_token_id=7)
    with pytest.raises(ValueError, match="neither holds an EOS"):
        replay([[5, 6]], [[8, 9]], cfg, CPU_LIKE, vocab_size=m.vocab_size)
    with pytest.raises(ValueError, match="temperature=0"):
        replay([[5, 6]], [[8, 7]], replace(cfg, temperature=1.0), CPU_LIKE, vocab_size=m.vocab_size)


# --------------------------------------------------------------------------------------------------------
# The command
def _job(tmp_path, *extra, data="jsonl"):
    path = write_chat_jsonl(tmp_path / "chat.jsonl", n=12)
    overrides = [
        "model=tiny-llama",
        f"data={data}",
        *([f"data.path={path}", "data.held_out=2"] if data == "jsonl" else []),
        "max_new_tokens=12",
        "batch_size=2",
        "costs=estimated",
        "max_ngram_sizes=[1,2]",
        f"cache={tmp_path / 'answers.json'}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="lookup_replay", overrides=overrides)


def test_the_command_caches_answers_resumes_and_reports_every_variant(tmp_path, monkeypatch):
    lines = run(_job(tmp_path, "num_prompts=3", f"output={tmp_path / 'report.md'}"))
    cache = json.loads((tmp_path / "answers.json").read_text())
    assert len(cache["records"]) == 3 and list(cache["costs"]) == ["estimated"]
    rows = [line for line in lines if line.startswith("| ") and "x |" in line]
    assert len(rows) == 2 * 2 * 2 * 2  # matches x sizes x EOS cuts x policies
    assert any(line.startswith("Best under policy=adaptive: **") for line in lines)
    assert "| n | position 1 |" in "\n".join(lines)
    assert (tmp_path / "report.md").read_text().splitlines() == lines
    # A rerun with more prompts keeps the answers it has and generates only the missing ones.
    first = cache["records"]
    run(_job(tmp_path, "num_prompts=5"))
    again = json.loads((tmp_path / "answers.json").read_text())["records"]
    assert len(again) == 5 and again[:3] == first
    # With every answer and the costs cached, the replay needs no model.
    monkeypatch.setattr(
        "fastdecode.runtime.loading.load_model", lambda *a, **k: pytest.fail("loaded the model")
    )
    assert run(_job(tmp_path, "num_prompts=4"))[2:] != []


def test_the_command_refuses_evaluation_sets_and_another_jobs_cache(tmp_path):
    with pytest.raises(ConfigError, match="evaluation-only"):
        run(_job(tmp_path, data="mt_bench"))
    run(_job(tmp_path, "num_prompts=1"))
    with pytest.raises(ConfigError, match="choose another cache path"):
        run(_job(tmp_path, "num_prompts=1", "max_new_tokens=13"))
