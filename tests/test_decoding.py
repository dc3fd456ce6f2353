"""Decoders: autoregressive equals HF generate; self-speculation equals autoregressive (greedy, fp32) and
samples from the target's distribution; each token passes each layer once; bad input fails clearly."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from fastdecode.config import ConfigError
from fastdecode.decoding.common import configure_engine, probabilities
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.policies import POLICIES, Adaptive, Confidence, Constant, DraftPolicy, Heuristic
from fastdecode.decoding.speculative import Draft, Verdict, accept
from fastdecode.registry import DECODERS, get_decoder
from fastdecode.runtime.model import EarlyExitModel
from tests.conftest import ENGINES, REFERENCE, TINY_MODELS
from tests.helpers import (
    assert_drafted_and_accepted,
    exact_joint,
    lively_model,
    pair_pvalues,
    random_prompts,
    tiny_vocab_model,
)

autoregressive = DECODERS["autoregressive"]
self_speculative = DECODERS["self_speculative"]


# --------------------------------------------------------------------------------------------------------
# Test models: copies of the shared tiny models (those are never mutated)


# --------------------------------------------------------------------------------------------------------
# Autoregressive
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", TINY_MODELS)
def test_autoregressive_greedy_equals_hf_generate(name, engine):
    m = lively_model(name)
    for prompt in random_prompts(3, seed=1):
        cfg = DecodeConfig(max_new_tokens=16, eos_token_id=m.config.eos_token_id, **ENGINES[engine])
        ours = autoregressive(m, [prompt], cfg).tokens[0]
        ids = torch.tensor([prompt])
        ref = m.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=16,
            eos_token_id=m.config.eos_token_id,
            pad_token_id=0,
        )
        assert ours == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("exit_layer", [None, 2])
def test_autoregressive_batch_equals_rows_alone(name, exit_layer, engine):
    m = lively_model(name)
    prompts = [
        random_prompts(1, seed=2, longest=3)[0],
        *random_prompts(2, seed=3, longest=14),
    ]  # different lengths
    cfg = DecodeConfig(max_new_tokens=20, exit_layer=exit_layer, **ENGINES[engine])
    batch = autoregressive(m, prompts, cfg)
    assert batch.tokens == [autoregressive(m, [p], cfg).tokens[0] for p in prompts]
    assert batch.tokens == autoregressive(m, prompts, replace(cfg, **REFERENCE)).tokens
    assert batch.layers_run == 3 * 19 * (exit_layer or m.num_layers)
    assert batch.layer_calls == 19 * (exit_layer or m.num_layers)


def test_pure_early_exit_differs_from_full_depth():
    m = lively_model("tiny-llama")
    prompts = random_prompts(3, seed=4)
    full = autoregressive(m, prompts, DecodeConfig(max_new_tokens=12)).tokens
    assert autoregressive(m, prompts, DecodeConfig(max_new_tokens=12, exit_layer=1)).tokens != full


# --------------------------------------------------------------------------------------------------------
# Self-speculative: greedy output is token-identical to autoregressive
# (the CPU default "fast" is lean layers with a mix of the kernels "packed" and "hf" use: covered by them)
@pytest.mark.parametrize("engine", ["hf", "packed", "static"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-opt"])
@pytest.mark.parametrize("upper_scale", [1.0, 0.1], ids=["random", "agreeable"])
def test_self_speculative_greedy_equals_autoregressive(name, upper_scale, engine):
    """Every E, every policy; 12 random prompts batched (ragged acceptance, holes), 3 batched, 2 alone.
    Sliding-window families (mistral, qwen2) check that windows count positions across holes. On every
    execution path, against autoregressive decoding on the reference path."""
    m = lively_model(name, upper_scale)
    prompts = random_prompts(12, seed=TINY_MODELS.index(name))
    base = DecodeConfig(max_new_tokens=20, draft_tokens=4, eos_token_id=m.config.eos_token_id)
    ref = autoregressive(m, prompts, replace(base, **REFERENCE)).tokens
    base = replace(base, **ENGINES[engine])
    assert autoregressive(m, prompts, base).tokens == ref
    rates = []
    for exit_layer, policy in itertools.product(range(1, m.num_layers), POLICIES):
        cfg = replace(base, exit_layer=exit_layer, policy=policy)
        out = self_speculative(m, prompts, cfg)
        assert out.tokens == ref, (exit_layer, policy)
        assert self_speculative(m, prompts[:3], cfg).tokens == ref[:3], (exit_layer, policy)
        for i in (3, 4):
            assert self_speculative(m, [prompts[i]], cfg).tokens == [ref[i]], (exit_layer, policy, i)
        assert out.oracle == out.accepted  # greedy: accepted = leading agreement with the verifier
        assert_drafted_and_accepted(out, exit_layer, policy)
        rates.append(out.acceptance_rate)
    if upper_scale < 1:  # long accepted runs, ragged rows and bonus tokens were exercised
        assert min(rates) > 0.3 and max(rates) < 1


@pytest.mark.parametrize("engine", ENGINES)
def test_zeroed_upper_layers_accept_every_draft(engine):
    m = lively_model("tiny-llama", zero_from=2)
    prompts = random_prompts(3, seed=5)
    cfg = DecodeConfig(max_new_tokens=20, exit_layer=2, draft_tokens=5, **ENGINES[engine])
    out = self_speculative(m, prompts, cfg)
    assert out.tokens == autoregressive(m, prompts, DecodeConfig(max_new_tokens=20, **REFERENCE)).tokens
    assert out.acceptance_rate == 1.0 and out.drafted[:3] == [5, 5, 5]
    assert out.steps == 4  # 1 token from the prefill, then 5 drafts + 1 bonus per round, capped at 20
    assert max(out.drafted) <= cfg.max_new_tokens - 1
    # Sequential layer calls: 3 rounds of 6 draft passes through 2 layers + 1 verify pass through 2, then
    # one plain step; autoregressive needs 19 passes through 4 layers.
    assert out.layer_calls == 3 * (6 * 2 + 2) + (2 + 2) < 19 * 4


@pytest.mark.parametrize("engine", ENGINES)
def test_eos_stops_each_row_once(engine):
    m = lively_model("tiny-llama", 0.1)
    prompts = random_prompts(3, seed=6)
    free = autoregressive(m, prompts, DecodeConfig(max_new_tokens=20, **REFERENCE)).tokens
    eos = free[0][5]
    cfg = DecodeConfig(max_new_tokens=20, eos_token_id=[eos, 999], **ENGINES[engine])
    ref = autoregressive(m, prompts, cfg).tokens
    assert ref[0] == free[0][: free[0].index(eos) + 1]
    for row, full in zip(ref, free, strict=True):
        assert row == (full[: full.index(eos) + 1] if eos in full else full)
    for policy in POLICIES:
        out = self_speculative(m, prompts, replace(cfg, exit_layer=2, policy=policy))
        assert out.tokens == ref
        assert_drafted_and_accepted(out, policy)


def test_confidence_policy_stops_right_after_the_unconfident_token():
    """Threshold 1: every draft token is unconfident, so every draft has exactly one token (the lagged host
    flag must not let an extra token in); threshold 0: never stop, drafts are K long."""
    m = lively_model("tiny-llama", 0.1)
    prompt = random_prompts(1, seed=7)
    one = self_speculative(
        m,
        prompt,
        DecodeConfig(
            max_new_tokens=20, exit_layer=2, policy="confidence", confidence_threshold=1.0, draft_tokens=6
        ),
    )
    assert set(one.drafted[:-1]) == {1} and one.drafted[-1] <= 1  # the last round may have no token left
    never = DecodeConfig(
        max_new_tokens=20, exit_layer=2, policy="confidence", confidence_threshold=0.0, draft_tokens=6
    )
    constant = replace(never, policy="constant")
    assert self_speculative(m, prompt, never).drafted == self_speculative(m, prompt, constant).drafted


def test_policies_unit():
    heuristic = Heuristic(4)
    heuristic.update([4, None, 4], [4, None, 4])
    assert heuristic.draft_limit() == 6
    heuristic.update([6, 2], [6, 6])
    assert heuristic.draft_limit() == 5
    heuristic.update([1, 3], [1, 3])  # ragged drafts (n-gram rows): each row accepted all it drafted
    assert heuristic.draft_limit() == 7
    confidence = Confidence(4, threshold=0.5)
    active = torch.tensor([True, False])
    assert not confidence.keep_drafting(torch.tensor([0.4, 0.9]), active)  # the finished row does not count
    assert confidence.keep_drafting(torch.tensor([0.6, 0.1]), active)
    adaptive = Adaptive(8, marginal=[0.5] * 8)
    adaptive.begin()
    keeps = [bool(adaptive.keep_drafting(torch.tensor([0.8]), torch.tensor([True]))) for _ in range(4)]
    assert keeps == [True, True, True, False]  # products 0.8, 0.64, 0.512 > c = 0.5 >= 0.41
    adaptive.update([0], [4])  # the first draft was rejected: calibration (1 + 0) / (1 + 0.8) = 0.56
    adaptive.begin()
    assert not adaptive.keep_drafting(torch.tensor([0.8]), torch.tensor([True]))
    # The marginal cost of each further token is the policy's bar: a step up in verification cost (the
    # T=3 -> T=4 step of a CPU) stops a draft that a flat cost would let grow.
    for marginal, expected in (([0.2, 0.2, 0.85, 0.3], [True, False]), ([0.2] * 4, [True, True])):
        stepped = Adaptive(8, marginal=marginal)
        stepped.begin()
        keeps = [bool(stepped.keep_drafting(torch.tensor([0.9]), torch.tensor([True]))) for _ in range(2)]
        assert keeps == expected  # after 2 drafts the estimate 0.81 is below the 3rd token's cost 0.85


def test_every_policy_derives_from_draft_policy():
    assert all(issubclass(policy, DraftPolicy) for policy in POLICIES.values())
    assert [p for p in POLICIES.values() if issubclass(p, Constant)] == [
        Constant
    ]  # not a base for the others
    for policy in POLICIES.values():
        assert policy(3, threshold=0.5, marginal=[0.25] * 3).draft_limit() == 3
        with pytest.raises(TypeError):  # threshold and marginal are keyword-only
            policy(3, 0.5, [0.25])


def test_accept_returns_a_verdict_with_named_fields():
    """Greedy and sampling rule on hand-made verifier logits ``[B=2, k+1=4, V=6]``, drafts ``[1, 2, 3]``."""
    target = torch.tensor([[1, 2, 3, 4], [1, 5, 3, 0]])  # row 0 agrees with all 3 drafts, row 1 with one
    logits = torch.full((2, 4, 6), -1e4).scatter_(-1, target[..., None], 0.0)
    tokens = torch.tensor([[1, 2, 3], [1, 2, 3]])
    greedy = accept(logits, Draft(tokens), DecodeConfig(4), generator=torch.Generator())
    assert isinstance(greedy, Verdict)
    assert Verdict._fields == ("accepted", "next_token", "oracle", "target")
    assert greedy.accepted.tolist() == [3, 1] and greedy.oracle.tolist() == [3, 1]
    assert greedy.next_token.tolist() == [4, 5]  # the bonus token, and the correction after one draft
    # Sampling with q == p: every draft the target would draw is accepted (r * q < p for r < 1).
    cfg = DecodeConfig(4, temperature=1.0)
    q = probabilities(logits[:, :3], cfg)
    sampled = accept(logits, Draft(target[:, :3], q), cfg, generator=torch.Generator())
    assert sampled.accepted.tolist() == [3, 3] and sampled.oracle.tolist() == [3, 3]
    assert sampled.next_token.tolist() == [4, 0]  # the bonus token drawn from p at the last position
    # Ragged drafts: row 1 drafted one token only; padding after it is never accepted, and its bonus token
    # is drawn from p right after its own draft.
    ragged = accept(logits, Draft(target[:, :3], q, lengths=[3, 1]), cfg, generator=torch.Generator())
    assert ragged.accepted.tolist() == [3, 1] and ragged.next_token.tolist() == [4, 5]
    greedy = accept(logits, Draft(tokens, lengths=[2, 3]), DecodeConfig(4), generator=torch.Generator())
    assert greedy.accepted.tolist() == [2, 1] and greedy.next_token.tolist() == [3, 5]


# --------------------------------------------------------------------------------------------------------
# Work accounting: one shared cache, each token through each layer once
def _count_layer_tokens(m: EarlyExitModel, layers):
    counts = [0] * m.num_layers

    def hook(index):
        def count(module, args, kwargs, output):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            counts[index] += hidden.shape[0] * hidden.shape[1]

        return count

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    return counts, handles


@pytest.mark.parametrize("engine", ENGINES)
def test_each_token_passes_each_layer_once_and_hf_runs_early_layers_more(engine):
    m = lively_model("tiny-llama", 0.1)
    exit_layer, prompt = 2, random_prompts(1, seed=8, longest=10)[0]
    cfg = DecodeConfig(max_new_tokens=24, exit_layer=exit_layer, draft_tokens=4, **ENGINES[engine])
    configure_engine(m, cfg)  # count the layers this path runs (the engine's, or the HF modules)
    counts, handles = _count_layer_tokens(m, m.engine.layers if m.engine is not None else m.layers)
    hf_counts, hf_handles = _count_layer_tokens(m, m.layers)
    handles += hf_handles
    try:
        out = self_speculative(m, [prompt], cfg)
        ours = list(counts)
        hf_counts[:] = [0] * m.num_layers
        ref = m.hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=None,
            pad_token_id=0,
            assistant_early_exit=exit_layer,
            num_assistant_tokens=4,
        )
    finally:
        for handle in handles:
            handle.remove()
    assert out.tokens[0] == ref[0, len(prompt) :].tolist()
    rejected = sum(out.drafted) - sum(out.accepted)
    fed = len(prompt) + len(out.tokens[0]) - 1  # the last new token is never fed back
    # Every layer saw the prompt, every fed generated token and the rejected drafts, each exactly once.
    assert ours == [fed + rejected] * m.num_layers
    assert rejected > 0 and sum(out.accepted) > 0
    assert out.layers_run == (fed + rejected - len(prompt)) * m.num_layers
    # HF's early-exit assistant keeps its own cache: its first E layers run the tokens again in verification.
    assert all(hf_counts[layer] > ours[layer] for layer in range(exit_layer))


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_cache_after_self_speculation_is_the_full_model_cache(engine):
    """After decoding, the valid slots of a row are exactly its prompt and fed tokens (holes masked)."""
    m = lively_model("tiny-llama", 0.1)
    prompts = random_prompts(3, seed=9)
    from fastdecode.drafters.exits import proposer as module

    captured = {}
    original = module.prefill

    def spy(*args, **kwargs):
        captured["state"] = state = original(*args, **kwargs)
        return state

    module.prefill = spy
    try:
        out = self_speculative(m, prompts, DecodeConfig(max_new_tokens=15, exit_layer=2, **ENGINES[engine]))
    finally:
        module.prefill = original
    cache = captured["state"].cache
    valid = cache.key_valid[:, : cache.lengths[0]].sum(1).tolist()
    assert valid == [len(p) + len(t) - 1 for p, t in zip(prompts, out.tokens, strict=True)]
    assert len(set(cache.lengths)) == 1
    assert 0 < sum(out.accepted) < sum(out.drafted)  # drafts were kept and rolled back: holes were made


# --------------------------------------------------------------------------------------------------------
# Speculative sampling is lossless


@pytest.mark.parametrize("engine", ["hf", "packed", "static"])
@pytest.mark.parametrize(
    ("processing", "policy"),
    [({}, "constant"), ({"top_k": 4}, "constant"), ({"top_p": 0.8}, "constant")]
    + [({}, policy) for policy in ("heuristic", "confidence", "adaptive")],
    ids=["plain", "top_k", "top_p", "heuristic", "confidence", "adaptive"],
)
def test_speculative_sampling_matches_the_target_distribution(processing, policy, engine):
    """4000 rows of one prompt, 4 new tokens (t1 from the prefill, t2-t3 drafted and verified, t4 a bonus or
    a correction): every adjacent pair's distribution matches the target's exactly computed one."""
    m = tiny_vocab_model()
    prompt, samples = [3, 1, 4, 1, 5], 4000
    cfg = DecodeConfig(
        max_new_tokens=4,
        temperature=1.0,
        exit_layer=1,
        draft_tokens=3,
        seed=1,
        policy=policy,
        **processing,
        **ENGINES[engine],
    )
    joint = exact_joint(m, prompt, 4, cfg)
    out = self_speculative(m, [prompt] * samples, cfg)
    assert 0.2 < out.acceptance_rate < 0.95  # both the accept and the residual paths were taken
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3
    target_only = autoregressive(m, [prompt] * samples, replace(cfg, exit_layer=None))
    assert min(pair_pvalues(target_only.tokens, joint)) > 1e-3
    # The test has power: sampling from the drafter alone (pure early exit) is clearly rejected.
    lossy = autoregressive(m, [prompt] * samples, cfg)
    assert min(pair_pvalues(lossy.tokens, joint)) < 1e-6


# --------------------------------------------------------------------------------------------------------
# Bad input
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"exit_layer": 0}, "exit_layer=0"),
        ({"exit_layer": -1}, "exit_layer=-1"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"policy": "dynamik"}, "Unknown draft-length policy 'dynamik'.*adaptive, confidence"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_config_raises(overrides, match):
    with pytest.raises(ConfigError, match=match):
        DecodeConfig(**{"max_new_tokens": 8, **overrides})


def test_bad_input_against_the_model_raises():
    m = lively_model("tiny-llama")
    with pytest.raises(ConfigError, match="exit_layer=4 but the model has 4 layers.*<= 3"):
        self_speculative(m, [[5, 6]], DecodeConfig(max_new_tokens=4, exit_layer=4))
    with pytest.raises(ConfigError, match="exit_layer=9"):
        autoregressive(m, [[5, 6]], DecodeConfig(max_new_tokens=4, exit_layer=9))
    with pytest.raises(ConfigError, match="needs decoder.exit_layer"):
        self_speculative(m, [[5, 6]], DecodeConfig(max_new_tokens=4))
    with pytest.raises(ConfigError, match="prompt 1 is empty"):
        autoregressive(m, [[5, 6], []], DecodeConfig(max_new_tokens=4))
    with pytest.raises(ConfigError, match="no prompts"):
        autoregressive(m, [], DecodeConfig(max_new_tokens=4))
    with pytest.raises(
        ConfigError, match="prompt 0 has 510 tokens.*is 512 and max_new_tokens=8.*at most 504"
    ):
        self_speculative(m, [[5] * 510], DecodeConfig(max_new_tokens=8, exit_layer=2))
    with pytest.raises(ConfigError, match="Unknown decoder 'speculative'.*self_speculative"):
        get_decoder("speculative")
    with pytest.raises(ConfigError, match="no separate draft model"):
        self_speculative(m, [[5, 6]], DecodeConfig(max_new_tokens=4, exit_layer=2), draft=m)
