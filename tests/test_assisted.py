"""Two-model speculative decoding: greedy output equals autoregressive and HF's assisted generation, sampling
follows the target's distribution, the drafter's cache holds exactly the accepted tokens, bad input fails."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastdecode.config import ConfigError, ModelConfig, load_group
from fastdecode.decoding import DECODERS, POLICIES, DecodeConfig, get_decoder
from fastdecode.decoding import assisted as assisted_module
from fastdecode.loading import load_model
from fastdecode.model import EarlyExitModel
from tests.conftest import ENGINES, REFERENCE
from tests.helpers import exact_joint, lively_model, pair_pvalues, random_prompts, tiny_vocab_model

assisted = DECODERS["assisted"]
autoregressive = DECODERS["autoregressive"]
self_speculative = DECODERS["self_speculative"]


# --------------------------------------------------------------------------------------------------------
# Draft models: same vocabulary (261 byte tokens) as the tiny target, other depth, family or width
def _target() -> EarlyExitModel:
    """The tiny Llama target: 4 layers whose upper layers write little, so shallow copies draft well."""
    return lively_model("tiny-llama", 0.1)


@functools.cache
def _draft(kind: str) -> EarlyExitModel:
    """``copy``: a 2-layer tiny Llama holding the target's embeddings, first two layers and head (so it
    drafts exactly like self-speculation with E=2). ``window``: the same weights in a 2-layer tiny *Mistral*
    (sliding window 16: windows across holes in the drafter's cache). ``other``: an unrelated 1-layer tiny
    Qwen2 of width 32 (attention biases): acceptance near 0, every rejection path."""
    name, overrides = {
        "copy": ("tiny-llama", {"num_hidden_layers": 2}),
        "window": ("tiny-mistral", {"num_hidden_layers": 2}),
        "other": ("tiny-qwen2", {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}),
    }[kind]
    base = load_group("model", name, ModelConfig)
    cfg = load_group(
        "model",
        name,
        ModelConfig,
        dtype="float32",
        device="cpu",
        random_init={**base.random_init, **overrides},
    )
    model, _ = load_model(cfg)
    with torch.no_grad():
        if kind in ("copy", "window"):
            missing = model.load_state_dict(_target().hf.state_dict(), strict=False).missing_keys
            assert not missing  # only the target's layers >= 2 are left over
        else:
            gen = torch.Generator().manual_seed(1)
            for param in model.parameters():
                if param.dim() == 2:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return EarlyExitModel(model)


# --------------------------------------------------------------------------------------------------------
# Greedy: token-identical to the target alone
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["copy", "window", "other"])
def test_assisted_greedy_equals_autoregressive(kind, engine):
    """Every policy; 12 random prompts batched (ragged acceptance, holes in both caches), 3 batched (of
    different lengths), 2 alone. The ``copy`` drafter is the target's first two layers, so every round must
    go exactly as in self-speculation with E=2 (bar ``adaptive``, whose cost ratio differs)."""
    m, draft = _target(), _draft(kind)
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
        assert low < out.acceptance_rate < high, policy
        if kind == "copy" and policy != "adaptive":
            selfspec = self_speculative(m, prompts, replace(cfg, exit_layer=2))
            assert (out.accepted, out.drafted) == (selfspec.accepted, selfspec.drafted), policy


@pytest.mark.parametrize("engine", ENGINES)
def test_draft_equal_to_the_target_accepts_every_draft(engine):
    m = _target()
    prompts = random_prompts(3, seed=12)
    cfg = DecodeConfig(max_new_tokens=20, draft_tokens=5, **ENGINES[engine])
    out = assisted(m, prompts, cfg, draft=m)
    assert out.tokens == autoregressive(m, prompts, replace(cfg, **REFERENCE)).tokens
    assert out.acceptance_rate == 1.0 and out.drafted[:3] == [5, 5, 5]
    assert out.steps == 4  # 1 token from the prefill, then 5 drafts + 1 bonus per round, capped at 20


def test_assisted_equals_hf_assisted_generation():
    m, draft = _target(), _draft("window")
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
    assert assisted(m, [prompt], cfg, draft=draft).tokens[0] == ref[0, len(prompt) :].tolist()


def test_drafter_cache_holds_exactly_the_accepted_tokens(monkeypatch):
    """After decoding, each cache's valid slots of a row are its prompt and fed tokens (the verifier's
    corrections and bonus tokens included), and the drafter's keys there equal a fresh drafter run over that
    text: the drafter never attends to a rejected draft and never misses an accepted token."""
    m, draft = _target(), _draft("copy")
    prompts = random_prompts(3, seed=14)
    states = []
    original = assisted_module.prefill

    def spy(*args, **kwargs):
        states.append(original(*args, **kwargs))
        return states[-1]

    monkeypatch.setattr(assisted_module, "prefill", spy)
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
        for layer in range(draft.num_layers):
            kept = draft_cache.k[layer][row][:, valid[row]]  # [H_kv, len(text), D]
            torch.testing.assert_close(kept, fresh.k[layer][0, :, : len(text)], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------------
# Sampling is lossless
@functools.cache
def _tiny_vocab_draft() -> EarlyExitModel:
    """An unrelated 1-layer drafter over the 8-token vocabulary of ``tiny_vocab_model``."""
    config = LlamaConfig(
        vocab_size=8,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,  # shorter than the target's 64
        initializer_range=0.15,
    )
    torch.manual_seed(1)
    return EarlyExitModel(LlamaForCausalLM(config).eval())


@pytest.mark.parametrize("engine", ["hf", "packed", "static"])
@pytest.mark.parametrize(
    ("processing", "policy"),
    [({}, "constant"), ({"top_k": 4}, "constant"), ({"top_p": 0.8}, "adaptive")],
    ids=["plain", "top_k", "top_p-adaptive"],
)
def test_assisted_sampling_matches_the_target_distribution(processing, policy, engine):
    """4000 rows of one prompt, 4 new tokens: every adjacent pair's distribution matches the target's exact
    one (see tests/test_decoding.py), while the drafter alone is clearly rejected (the test has power)."""
    m, draft = tiny_vocab_model(), _tiny_vocab_draft()
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
    m = _target()
    cfg = DecodeConfig(max_new_tokens=4)
    assert get_decoder("assisted") is assisted
    with pytest.raises(ConfigError, match="needs a draft model: pass draft="):
        assisted(m, [[5, 6]], cfg)
    with pytest.raises(
        ConfigError, match="draft model's vocabulary has 8 tokens but the target's has 261.*same tokenizer"
    ):
        assisted(m, [[5, 6]], cfg, draft=_tiny_vocab_draft())
    with pytest.raises(ConfigError, match="exit_layer=2 has no meaning here; set decoder.exit_layer=null"):
        assisted(m, [[5, 6]], replace(cfg, exit_layer=2), draft=_draft("copy"))
    with pytest.raises(ConfigError, match="30 tokens but the draft model's context.*is 32.*at most 28"):
        assisted(tiny_vocab_model(), [[1] * 30], DecodeConfig(max_new_tokens=4), draft=_tiny_vocab_draft())


def test_cost_ratio_counts_the_weights_read_per_token():
    m, draft = _target(), _draft("other")
    layer = sum(p.numel() for p in m.layers[0].parameters())
    assert m.step_cost() == 4 * layer + 261 * 64
    assert m.step_cost(depth=2, head_rows=10) == 2 * layer + 10 * 64
    assert 0 < draft.step_cost() / m.step_cost() < 0.25
