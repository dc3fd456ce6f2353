"""Two-model speculative decoding: greedy output equals autoregressive and HF's assisted generation, sampling
follows the target's distribution, the drafter's cache holds exactly the accepted tokens, bad input fails."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fastdecode.config import ConfigError
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.policies import POLICIES
from fastdecode.drafters.draft_model import proposer as proposers_module
from fastdecode.registry import DECODERS, get_decoder
from tests.conftest import ENGINES, REFERENCE
from tests.helpers import (
    assert_drafted_and_accepted,
    assisted_target,
    draft_model,
    exact_joint,
    model_tolerance,
    pair_pvalues,
    random_prompts,
    tiny_vocab_draft,
    tiny_vocab_model,
)

assisted = DECODERS["assisted"]
autoregressive = DECODERS["autoregressive"]
self_speculative = DECODERS["self_speculative"]


# --------------------------------------------------------------------------------------------------------
# Draft models: same vocabulary (261 byte tokens) as the tiny target, other depth, family or width


# --------------------------------------------------------------------------------------------------------
# Greedy: token-identical to the target alone
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["copy", "window", "other"])
def test_assisted_greedy_equals_autoregressive(kind, engine):
    """Every policy; 12 random prompts batched (ragged acceptance, holes in both caches), 3 batched (of
    different lengths), 2 alone. The ``copy`` drafter is the target's first two layers, so every round must
    go exactly as in self-speculation with E=2 (bar ``adaptive``, whose cost ratio differs)."""
    m, draft = assisted_target(), draft_model(kind)
    prompts = random_prompts(12, seed=11)
    base = DecodeConfig(max_new_tokens=20, draft_tokens=4, eos_token_id=m.config.eos_token_id)
    ref = autoregressive(m, prompts, replace(base, **REFERENCE)).tokens
    base = replace(base, **ENGINES[engine])
    for policy in POLICIES:
        cfg = replace(base, policy=policy)
        out = assisted(m, prompts, cfg, draft=draft)
        assert out.tokens == ref, policy
        assert assisted(m, prompts[:3], cfg, draft=draft).tokens == ref[:3], policy
        for i in (3, 4):
            assert assisted(m, [prompts[i]], cfg, draft=draft).tokens == [ref[i]], (policy, i)
        assert out.oracle == out.accepted  # greedy: accepted = leading agreement with the target
        low, high = {"copy": (0.3, 1), "window": (0.1, 1), "other": (-1, 0.2)}[kind]
        assert low < out.acceptance_rate < high and sum(out.drafted) > 0, policy
        if kind == "copy" and policy != "adaptive":
            selfspec = self_speculative(m, prompts, replace(cfg, exit_layer=2))
            assert (out.accepted, out.drafted) == (selfspec.accepted, selfspec.drafted), policy


@pytest.mark.parametrize("engine", ENGINES)
def test_draft_equal_to_the_target_accepts_every_draft(engine):
    m = assisted_target()
    prompts = random_prompts(3, seed=12)
    cfg = DecodeConfig(max_new_tokens=20, draft_tokens=5, **ENGINES[engine])
    out = assisted(m, prompts, cfg, draft=m)
    assert out.tokens == autoregressive(m, prompts, replace(cfg, **REFERENCE)).tokens
    assert out.acceptance_rate == 1.0 and out.drafted[:3] == [5, 5, 5]
    assert out.steps == 4  # 1 token from the prefill, then 5 drafts + 1 bonus per round, capped at 20


def test_assisted_equals_hf_assisted_generation():
    m, draft = assisted_target(), draft_model("window")
    prompt = random_prompts(1, seed=13)[0]
    cfg = DecodeConfig(max_new_tokens=24, draft_tokens=4)
    ids = torch.tensor([prompt])
    ref = m.hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        assistant_model=draft.hf,
        do_sample=False,
        max_new_tokens=24,
        eos_token_id=None,
        pad_token_id=0,
    )
    ours = assisted(m, [prompt], cfg, draft=draft)
    assert ours.tokens[0] == ref[0, len(prompt) :].tolist()
    assert_drafted_and_accepted(ours)


def test_drafter_cache_holds_exactly_the_accepted_tokens(monkeypatch):
    """After decoding, each cache's valid slots of a row are its prompt and fed tokens (the verifier's
    corrections and bonus tokens included), and the drafter's keys there equal a fresh drafter run over that
    text: the drafter never attends to a rejected draft and never misses an accepted token."""
    m, draft = assisted_target(), draft_model("copy")
    prompts = random_prompts(3, seed=14)
    states = []
    original = proposers_module.prefill

    def spy(*args, **kwargs):
        states.append(original(*args, **kwargs))
        return states[-1]

    monkeypatch.setattr(proposers_module, "prefill", spy)  # the target's prefill, then the drafter's
    cfg = DecodeConfig(max_new_tokens=16, draft_tokens=3, policy="heuristic")
    out = assisted(m, prompts, cfg, draft=draft)
    assert 0 < out.acceptance_rate < 1
    target_cache, draft_cache = (state.cache for state in states)
    assert target_cache.lengths[0] == draft_cache.lengths[0] == draft_cache.lengths[-1]
    end = draft_cache.lengths[0]
    valid = draft_cache.key_valid[:, :end]
    assert torch.equal(valid, target_cache.key_valid[:, :end])
    for row, (prompt, new) in enumerate(zip(prompts, out.tokens, strict=True)):
        text = prompt + new[:-1]  # the last new token is never fed back
        assert int(valid[row].sum()) == len(text)
        fresh = draft.new_cache(1, len(text))
        draft.forward(torch.tensor([text]), cache=fresh)
        for layer in range(draft.num_layers):  # written in rounds of the batch against one pass of the row
            kept = draft_cache.k[layer][row][:, :end][:, valid[row]]  # [H_kv, len(text), D]
            want = fresh.k[layer][0, :, : len(text)]
            torch.testing.assert_close(kept, want, **model_tolerance(draft.config, end, want))


# --------------------------------------------------------------------------------------------------------
# Sampling is lossless


@pytest.mark.parametrize("engine", ["hf", "packed", "static"])
@pytest.mark.parametrize(
    ("processing", "policy"),
    [({}, "constant"), ({"top_k": 4}, "constant"), ({"top_p": 0.8}, "adaptive")],
    ids=["plain", "top_k", "top_p-adaptive"],
)
def test_assisted_sampling_matches_the_target_distribution(processing, policy, engine):
    """4000 rows of one prompt, 4 new tokens: every adjacent pair's distribution matches the target's exact
    one (see tests/test_decoding.py), while the drafter alone is clearly rejected (the test has power)."""
    m, draft = tiny_vocab_model(), tiny_vocab_draft()
    prompt, samples = [3, 1, 4, 1, 5], 4000
    cfg = DecodeConfig(
        max_new_tokens=4,
        temperature=1.0,
        draft_tokens=3,
        seed=2,
        policy=policy,
        **processing,
        **ENGINES[engine],
    )
    joint = exact_joint(m, prompt, 4, cfg)
    out = assisted(m, [prompt] * samples, cfg, draft=draft)
    assert 0.2 < out.acceptance_rate < 0.95  # both the accept and the residual paths were taken
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3
    drafter_only = autoregressive(draft, [prompt] * samples, cfg)
    assert min(pair_pvalues(drafter_only.tokens, joint)) < 1e-6


# --------------------------------------------------------------------------------------------------------
# Bad input
def test_bad_draft_raises():
    m = assisted_target()
    cfg = DecodeConfig(max_new_tokens=4)
    assert get_decoder("assisted") is assisted
    with pytest.raises(ConfigError, match="needs a draft model: pass draft="):
        assisted(m, [[5, 6]], cfg)
    with pytest.raises(
        ConfigError, match="draft model's vocabulary has 8 tokens but the target's has 261.*same tokenizer"
    ):
        assisted(m, [[5, 6]], cfg, draft=tiny_vocab_draft())
    with pytest.raises(ConfigError, match="exit_layer=2 has no meaning here; set decoder.exit_layer=null"):
        assisted(m, [[5, 6]], replace(cfg, exit_layer=2), draft=draft_model("copy"))
    with pytest.raises(ConfigError, match="30 tokens but the draft model's context.*is 32.*at most 28"):
        assisted(tiny_vocab_model(), [[1] * 30], DecodeConfig(max_new_tokens=4), draft=tiny_vocab_draft())


def test_cost_ratio_counts_the_weights_read_per_token():
    m, draft = assisted_target(), draft_model("other")
    layer = sum(p.numel() for p in m.layers[0].parameters())
    assert m.step_cost() == 4 * layer + 261 * 64
    assert m.step_cost(depth=2, head_rows=10) == 2 * layer + 10 * 64
    assert 0 < draft.step_cost() / m.step_cost() < 0.25
