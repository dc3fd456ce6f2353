"""The DFlash proposer: its first block against the drafter run by hand, one drafter forward per round, a
context cache that follows the target's, lossless decoding (greedy on every family and policy, ragged
batches, chains after prompt lookup and suffix decoding, execution paths, 4-bit weights; sampling by a
chi-square test), its costs, ``auto``'s plan from its record and the checks on the drafter directory."""

from __future__ import annotations

import itertools
import shutil
from dataclasses import replace

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from fastdecode.api import FastDecoder
from fastdecode.config import ConfigError
from fastdecode.decoding.autoregressive import generate as autoregressive
from fastdecode.decoding.common import Rows
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.policies import POLICIES
from fastdecode.decoding.speculative import Round
from fastdecode.drafters.dflash import kind as dflash_kind
from fastdecode.drafters.dflash.files import SPECULATORS_DIR, DFlashFileError, Verifier, save_dflash
from fastdecode.drafters.dflash.kind import load_draft, pass_costs
from fastdecode.drafters.dflash.layer import DFlashDraft
from fastdecode.drafters.dflash.proposer import DFlashProposer
from fastdecode.drafters.lookup.options import LookupOptions
from fastdecode.drafters.suffix.options import SuffixOptions
from fastdecode.plan.acceptance import AcceptanceRecord, DrafterRecord, write_record
from fastdecode.plan.cost import estimate_costs
from fastdecode.registry import DECODERS, PROPOSERS, check_drafter, drafter_kind
from fastdecode.runtime.model import EarlyExitModel
from tests.conftest import ENGINES, REFERENCE, TINY_MODELS
from tests.dflash_drafters import drafter_dir, random_drafter_dir, training_sequences
from tests.eagle3_heads import random_head_dir
from tests.helpers import (
    assert_drafted_and_accepted,
    exact_joint,
    lively_model,
    pair_pvalues,
    random_prompts,
    tiny_model,
    tiny_vocab_model,
)


def target(name: str = "tiny-llama") -> EarlyExitModel:
    """A tiny target whose upper layers write little (its greedy text is not a repetition)."""
    return lively_model(name, 0.1)


def mixed_prompts(m: EarlyExitModel) -> list[list[int]]:
    """8 prefixes (8..20 tokens) of the drafter's training sequences (its drafts are accepted there) and 4
    random prompts (rejected there): ragged prompts, ragged acceptance, holes."""
    seqs = training_sequences(m)
    return [seqs[i, : 8 + (3 * i) % 13].tolist() for i in range(8)] + random_prompts(4, seed=61)


def config(m: EarlyExitModel, **options) -> DecodeConfig:
    eos = m.config.eos_token_id
    return DecodeConfig(
        **{"max_new_tokens": 20, "draft_tokens": 4, "costs": "estimated", "eos_token_id": eos} | options
    )


# --------------------------------------------------------------------------------------------------------
# The block
def test_the_first_block_equals_the_drafter_run_by_hand_on_each_row():
    """Two ragged prompts prefilled (left padding: holes in the context), one block drafted: each row's
    drafts are the argmax of the target's head on the drafter run on that row alone, its context the
    Hugging Face hidden states of the prompt, its block [t, MASK, ...] at the positions after it."""
    m = target()
    path = drafter_dir(m)
    draft = load_draft(path, m)
    prompts = [training_sequences(m)[0, :12].tolist(), [7, 8, 9, 10, 11]]
    cfg = DecodeConfig(max_new_tokens=8)
    proposer = DFlashProposer(m, draft, cfg, costs=estimate_costs(m))
    proposer.policy = POLICIES["constant"](3)
    last = torch.tensor([50, 60])
    with torch.inference_mode():
        state = proposer.start(m, prompts, 32)
        r = Round(last, state.positions, torch.tensor([True, True]), 3, Rows(2, cfg), state.cache.lengths[0])
        drafted = proposer.propose(r).tokens
    c = draft.config
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            hidden = m.hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
            features = torch.cat([hidden[i] for i in c.feature_ids], -1)
            context = draft.context_kv(features, torch.arange(len(prompt))[None])
            block = torch.tensor([[int(last[row])] + [c.mask_token_id] * (c.block_size - 1)])
            positions = len(prompt) + torch.arange(c.block_size)[None]
            out = draft(m.token_embed(block), positions, context)
        assert drafted[row].tolist() == m.lm_head(out[0, 1:4]).argmax(-1).tolist(), row


def watch(monkeypatch) -> dict:
    """Check every round of every DFlash proposer: at most one drafter forward (exactly one when it drafted
    its own block), and after ``update`` a context cache as long as the target's, with its slot validity,
    each slot written once (never a block's keys)."""
    seen = {"calls": 0, "rounds": 0, "passes": 0}
    forward, start, update = DFlashDraft.forward, DFlashProposer.start, DFlashProposer.update

    def counted(self, *args, **kwargs):
        seen["calls"] += 1
        return forward(self, *args, **kwargs)

    def started(self, m, prompts, capacity):
        state = start(self, m, prompts, capacity)
        self.target, self.before = state.cache, self.passes
        return state

    def updated(self, r, draft, verdict, done):
        update(self, r, draft, verdict, done)
        passes = self.passes - self.before
        assert passes in (0, 1) and seen["calls"] - seen["passes"] == passes
        seen["rounds"], seen["passes"], self.before = seen["rounds"] + 1, seen["calls"], self.passes
        if self.retired:
            return
        length, cache = self.target.lengths[0], self.context.cache
        assert cache.lengths == [length] * len(cache.lengths) and cache.writes == cache.lengths
        assert torch.equal(cache.key_valid[:, :length], self.target.key_valid[:, :length])

    monkeypatch.setattr(DFlashDraft, "forward", counted)
    monkeypatch.setattr(DFlashProposer, "start", started)
    monkeypatch.setattr(DFlashProposer, "update", updated)
    return seen


# --------------------------------------------------------------------------------------------------------
# Lossless
@pytest.mark.parametrize("name", TINY_MODELS)
def test_dflash_greedy_equals_autoregressive(name, monkeypatch):
    """Every policy; 12 ragged prompts batched, 3 batched, 2 alone; drafts accepted and rejected; one drafter
    forward per round and the context cache in step with the target's throughout."""
    m = target(name)
    path, prompts = drafter_dir(m), mixed_prompts(m)
    base = config(m, drafter=path)
    ref = autoregressive(m, prompts, replace(base, **REFERENCE)).tokens
    seen = watch(monkeypatch)
    for policy in POLICIES:
        cfg = replace(base, policy=policy)
        out = DECODERS["dflash"](m, prompts, cfg)
        assert out.tokens == ref and out.oracle == out.accepted, policy
        assert_drafted_and_accepted(out, policy)
        assert sum(out.drafted) > sum(out.accepted), policy  # rejections too
        assert DECODERS["dflash"](m, prompts[:3], cfg).tokens == ref[:3], policy
        for i in (1, 9):
            assert DECODERS["dflash"](m, [prompts[i]], cfg).tokens == [ref[i]], (policy, i)
    assert seen["rounds"] > 0 and 0 < seen["calls"] <= seen["rounds"]
    # On the text it learnt, the drafter's blocks are right round after round: the context it writes after
    # each verification holds the right positions' features (shifted by one token, this drops to ~0.4).
    learnt = DECODERS["dflash"](m, prompts[:8], replace(base, policy="constant"))
    assert learnt.tokens == ref[:8] and learnt.acceptance_rate > 0.8, learnt.acceptance_rate


@pytest.mark.parametrize("engine", ["hf", "packed", "static"])
def test_chains_after_prompt_lookup_and_suffix_decoding_on_every_execution_path(engine, monkeypatch):
    """Prompt lookup or suffix decoding first, the drafter where they find nothing (never retired, or
    retired after one row-round); repetitive prompts so the first stage drafts too; the context still
    follows the target's in the rounds the first stage drafted (no drafter pass there)."""
    m = target("tiny-qwen2")
    path = drafter_dir(m)
    prompts = mixed_prompts(m)[:6] + [p * 3 for p in random_prompts(3, seed=4)]
    base = replace(config(m, drafter=path, chain=True, max_new_tokens=16), **ENGINES[engine])
    ref = autoregressive(m, prompts, replace(base, **REFERENCE)).tokens
    seen = watch(monkeypatch)
    first = {"prompt_lookup": {}, "suffix": {"suffix": SuffixOptions(first=True, global_size=0)}}
    for (stage, groups), trial in itertools.product(first.items(), (0, 1)):
        cfg = replace(base, groups={**groups, "lookup": LookupOptions(fallback_trial=trial)})
        out = DECODERS["dflash"](m, prompts, cfg)
        assert out.tokens == ref, (stage, trial)
        assert out.by_proposer[stage][0] > 0, out.by_proposer
        if not trial:  # the drafter's own blocks were accepted in the chain, beside the first stage's
            assert out.by_proposer["dflash"][0] > 0, out.by_proposer
    assert seen["rounds"] > seen["calls"] > 0  # rounds the first stage drafted ran no drafter pass


def test_dflash_on_int4_weights_equals_its_autoregressive_decoding():
    m = target()
    prompts = mixed_prompts(m)[:6]
    base = config(m, weights="int4")
    ref = DECODERS["autoregressive"](m, prompts, base).tokens
    for chain in (False, True):
        out = DECODERS["dflash"](m, prompts, replace(base, drafter=drafter_dir(m), chain=chain))
        assert out.tokens == ref and out.weights.startswith("int4"), chain
        assert_drafted_and_accepted(out, chain)


@pytest.mark.parametrize("chain", [False, True])
def test_dflash_sampling_matches_the_target_distribution(tmp_path, chain):
    """4000 rows of one prompt, 4 new tokens: the block's argmax drafts, each a point mass, are accepted by
    the lossless rule or replaced by the residual's draw (in a chain, rows the lookup matches draft its
    tokens); every adjacent pair's distribution matches the target's exactly computed one."""
    m = tiny_vocab_model()
    path = random_drafter_dir(tmp_path, m, mask=7)
    prompt, samples = [3, 1, 4, 1, 5], 4000
    cfg = DecodeConfig(
        max_new_tokens=4,
        temperature=1.0,
        draft_tokens=3,
        seed=3,
        costs="estimated",
        drafter=path,
        chain=chain,
    ).with_options(LookupOptions(fallback_trial=0))
    joint = exact_joint(m, prompt, 4, cfg)
    out = DECODERS["dflash"](m, [prompt] * samples, cfg)
    accepted, drafted = sum(out.accepted), sum(out.drafted)
    assert accepted > 100 and drafted - accepted > 100  # both the accept and the residual paths were taken
    if chain:
        assert out.by_proposer["dflash"][1] > 100 and out.by_proposer["prompt_lookup"][1] > 100
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3


# --------------------------------------------------------------------------------------------------------
# Costs and the plan
def test_a_round_costs_one_pass_the_head_over_its_drafts_and_the_verification(monkeypatch):
    m = target()
    draft = load_draft(drafter_dir(m), m)
    estimated = estimate_costs(m)
    passed, written = pass_costs(estimated, m, draft, 5)
    assert 0 < written < passed < 1.0  # a one-layer drafter over 5 slots: less than a plain step
    calls = []

    def timer(name, fn, device):
        fn()
        calls.append(name)
        return {("dflash_pass",): 0.003, ("dflash_write",): 0.001, ("step",): 0.01}[name]

    monkeypatch.setattr(dflash_kind, "timed", timer)
    measured = replace(estimated, source="measured", step_seconds=123.0, batch=3)  # never its step_seconds
    assert pass_costs(measured, m, draft, 5) == pytest.approx((0.3, 0.1))
    assert len(calls) == 3 * (dflash_kind.PASS_REPEATS + 1)
    assert pass_costs(measured, m, draft, 5) == pytest.approx((0.3, 0.1)) and len(calls) == 24  # kept
    cfg = DecodeConfig(max_new_tokens=4)
    proposer = DFlashProposer(m, draft, cfg, costs=measured, pass_cost=0.3, write_cost=0.1)
    for k in (1, 3, 4):  # one pass whatever K; the head over the K drafted slots only
        want = 0.3 + 0.1 + measured.head_cost(k) + measured.verify(k + 1)
        assert proposer.round_cost(k) == pytest.approx(want), k
    assert proposer.round_cost(0) == pytest.approx(0.1 + measured.verify(1))  # no pass: a plain step
    assert proposer.ride_cost() == 0.1 and proposer.token_cost() == 0.0


def test_generate_drafts_with_it_and_auto_plans_it_from_its_record(tmp_path):
    """``generate(method="dflash", drafter=PATH)`` is lossless, and the drafter given at load is the
    method's default; with ``<PATH>/acceptance.json`` recording its acceptance, ``auto`` prices it (one pass
    per round, no K past the block) and runs it, chained after prompt lookup."""
    m = target()
    path = tmp_path / "dflash"
    shutil.copytree(drafter_dir(m), path)
    assert drafter_kind(path) == check_drafter(path) == "dflash"
    assert drafter_kind(random_head_dir(tmp_path)) == "eagle3"
    tokenizer = tiny_model("tiny-llama")[1]
    prompts = mixed_prompts(m)[:4]
    ref = autoregressive(m, prompts, config(m, max_new_tokens=12)).tokens
    fd = FastDecoder(m.hf, tokenizer, m=m, drafter=str(path))
    result = fd.generate(prompts, max_new_tokens=12, method="dflash", costs="estimated")
    assert result.ids == ref and result.method == "dflash"
    assert_drafted_and_accepted(result.output)
    assert all(c.method != "dflash" for c in fd.plan(1, costs="estimated").candidates)  # nothing recorded
    rounds = {1: 1.97, 2: 2.9, 3: 3.8, 4: 4.7, 5: 5.5, 6: 6.3}
    write_record(path, AcceptanceRecord([DrafterRecord("dflash", 0.97, tokens_per_round=rounds)]))
    fd = FastDecoder(m.hf, tokenizer, m=m)  # a new one: plans are kept per decoder
    plan = fd.plan(1, costs="estimated", drafter=str(path))
    assert plan.best.method == "dflash" and plan.best.options["drafter"] == str(path), plan
    assert plan.best.options["chain"] is True and plan.best.draft <= 4  # the block has 5 slots
    auto = fd.generate(prompts, max_new_tokens=12, method="auto", drafter=str(path), costs="estimated")
    assert auto.ids == ref and auto.method == "dflash"
    assert auto.output.by_proposer["dflash"][0] > 0


# --------------------------------------------------------------------------------------------------------
# Bad input
def test_dflash_refuses_a_missing_a_foreign_or_a_mismatched_drafter(tmp_path):
    m = target()
    prompts, cfg = [[5, 6, 7]], DecodeConfig(max_new_tokens=4)
    with pytest.raises(ConfigError, match="needs decoder.drafter"):
        DECODERS["dflash"](m, prompts, cfg)
    with pytest.raises(DFlashFileError, match="no such file"):
        DECODERS["dflash"](m, prompts, replace(cfg, drafter=str(tmp_path / "nowhere")))
    with pytest.raises(DFlashFileError, match="is not a DFlash drafter"):  # an EAGLE-3 head
        DECODERS["dflash"](m, prompts, replace(cfg, drafter=random_head_dir(tmp_path)))
    other = random_drafter_dir(tmp_path / "small", tiny_vocab_model(), mask=7)
    with pytest.raises(ConfigError, match="hidden size 32, but this model has 64"):
        DECODERS["dflash"](m, prompts, replace(cfg, drafter=other))
    path = random_drafter_dir(tmp_path)
    with pytest.raises(ConfigError, match="decoder.lookup.tree=true: decoder 'dflash' drafts chains"):
        DECODERS["dflash"](m, prompts, replace(cfg, drafter=path, groups={"lookup": {"tree": True}}))
    with pytest.raises(ConfigError, match="slots=6: the drafter's block has 5 slots"):
        DECODERS["dflash"](m, prompts, replace(cfg, drafter=path, groups={"dflash": {"slots": 6}}))
    with pytest.raises(ConfigError, match="slots=1"):
        DECODERS["dflash"](m, prompts, replace(cfg, drafter=path, groups={"dflash": {"slots": 1}}))
    projected = OPTConfig(
        vocab_size=261, hidden_size=64, word_embed_proj_dim=32, ffn_dim=128, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    opt = EarlyExitModel(OPTForCausalLM(projected).eval())
    with pytest.raises(ConfigError, match="head reads 32-wide states, not its hidden size 64"):
        DECODERS["dflash"](opt, prompts, replace(cfg, drafter=random_drafter_dir(tmp_path / "opt", opt)))


def test_fewer_slots_draft_fewer_tokens_and_stay_lossless():
    """``decoder.dflash.slots=3``: a block of 3 drafts at most 2 tokens a round, lossless."""
    m = target()
    prompts = mixed_prompts(m)
    base = config(m, drafter=drafter_dir(m), policy="constant")
    ref = autoregressive(m, prompts, base).tokens
    out = DECODERS["dflash"](m, prompts, replace(base, groups={"dflash": {"slots": 3}}))
    assert out.tokens == ref and max(out.drafted) == 2
    assert_drafted_and_accepted(out)
    assert PROPOSERS["dflash"].chainable


def test_a_drafter_in_the_speculators_format_decodes_like_its_native_twin(tmp_path):
    """The same drafter saved in both formats (``save_dflash(..., speculators=)``): the ``speculators/``
    directory is told a DFlash drafter by its config and drafts exactly as the native one."""
    m = target()
    embed, head = m.hf.get_input_embeddings().weight, m.lm_head.weight
    path = save_dflash(
        load_draft(drafter_dir(m), m), tmp_path / "both", speculators=Verifier("tiny", embed, head)
    )
    twin = path / SPECULATORS_DIR
    assert drafter_kind(twin) == check_drafter(twin) == "dflash"
    prompts = mixed_prompts(m)
    base = config(m, policy="constant")
    native = DECODERS["dflash"](m, prompts, replace(base, drafter=str(path)))
    speculators = DECODERS["dflash"](m, prompts, replace(base, drafter=str(twin)))
    assert speculators.tokens == native.tokens == autoregressive(m, prompts, base).tokens
    assert speculators.accepted == native.accepted and sum(native.accepted) > 0
