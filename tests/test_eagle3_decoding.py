"""The EAGLE-3 proposer: features captured by the verification, the head's drafts against the head run by
hand, lossless decoding (greedy on every family, ragged batches, chains, execution paths; sampling by a
chi-square test) and the checks on the head directory."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace

import pytest
import torch

from fastdecode import api
from fastdecode.api import FastDecoder
from fastdecode.bench.config import plan as speed_plan
from fastdecode.config import ConfigError
from fastdecode.decoding.autoregressive import generate as autoregressive
from fastdecode.decoding.common import Rows, prefill
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.policies import POLICIES
from fastdecode.decoding.policies import POLICIES as POLICY_CLASSES
from fastdecode.decoding.speculative import Draft, Round, Settled, verify
from fastdecode.drafters.eagle3 import kind as eagle3_kind
from fastdecode.drafters.eagle3.files import WEIGHTS_FILE, Eagle3FileError, save_eagle3
from fastdecode.drafters.eagle3.kind import head_token_cost, load_head
from fastdecode.drafters.eagle3.layer import Eagle3KV
from fastdecode.drafters.eagle3.model import Eagle3Config, Eagle3Head
from fastdecode.drafters.eagle3.proposer import Eagle3Proposer
from fastdecode.drafters.lookup.options import LookupOptions
from fastdecode.plan.acceptance import AcceptanceRecord, DrafterRecord, write_record
from fastdecode.plan.cost import estimate_costs
from fastdecode.registry import DECODERS, PROPOSERS
from fastdecode.runtime.model import EarlyExitModel
from tests.conftest import ENGINES, REFERENCE, TINY_MODELS
from tests.eagle3_heads import (
    head_dir,
    random_head_dir,
    random_tiny_vocab_head,
    target_batch,
    train_head,
    training_sequences,
)
from tests.helpers import (
    assert_drafted_and_accepted,
    exact_joint,
    lively_model,
    model_tolerance,
    padded_verification,
    pair_pvalues,
    random_prompts,
    tiny_model,
    tiny_vocab_model,
)
from tests.job_configs import speed_cfg


def target(name: str) -> EarlyExitModel:
    """A tiny target whose upper layers write little (its greedy text is not a repetition)."""
    return lively_model(name, 0.1)


def mixed_prompts(m: EarlyExitModel) -> list[list[int]]:
    """8 prefixes (8..20 tokens) of the head's training sequences (its drafts are accepted there) and 4
    random prompts (rejected there): ragged prompts, ragged acceptance, holes."""
    seqs = training_sequences(m)
    return [seqs[i, : 8 + (3 * i) % 13].tolist() for i in range(8)] + random_prompts(4, seed=61)


# --------------------------------------------------------------------------------------------------------
# The seam: features captured by the verification
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_verification_captures_the_hf_hidden_states_at_the_feature_layers(name):
    m = EarlyExitModel(tiny_model(name)[0])
    prompt, drafts = [5, 9, 13, 40, 7], [11, 12, 200]
    layers = (2, 4, 0)  # 4 = L: after the final norm, as Hugging Face's last hidden state
    with torch.inference_mode():
        state = prefill(m, [prompt], 16)
        rows = Rows(1, DecodeConfig(max_new_tokens=8))
        r = Round(torch.tensor([30]), state.positions, torch.tensor([True]), 3, rows, state.cache.lengths[0])
        draft = Draft(torch.tensor([drafts]))
        logits = verify(m, state.cache, r, draft, layers)
        out = m.hf(torch.tensor([prompt + [30] + drafts]), output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i][:, len(prompt) :] for i in layers], -1)
    # the prefilled cache and a block of 4 against one pass of HF's layers
    width, want = len(prompt) + 4, out.logits[:, len(prompt) :]
    torch.testing.assert_close(draft.features, expected, **model_tolerance(m.config, width, expected))
    torch.testing.assert_close(logits, want, **model_tolerance(m.config, width, want))


def test_the_first_drafts_equal_the_head_run_by_hand_on_the_full_sequence():
    """Prefill two ragged prompts, draft 3 tokens: each row's drafts are those of the head run on that row
    alone (rows 1.. of the sequence paired with the features before them), then chained on its own output."""
    m = target("tiny-llama")
    head = load_head(head_dir(m), m)
    prompts = [training_sequences(m)[0, :12].tolist(), [7, 8, 9, 10, 11]]
    cfg = DecodeConfig(max_new_tokens=8)
    proposer = Eagle3Proposer(m, head, cfg, torch.Generator(), costs=None)
    proposer.policy = POLICY_CLASSES["constant"](3)
    last = torch.tensor([50, 60])
    with torch.inference_mode():
        state = proposer.start(m, prompts, 32)
        r = Round(last, state.positions, torch.tensor([True, True]), 3, Rows(2, cfg), state.cache.lengths[0])
        drafted = proposer.propose(r).tokens
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([prompt + [int(last[row])]])
        batch = target_batch(m, ids, head.config.aux_layer_ids)
        positions = torch.arange(1, ids.shape[1])[None]
        kv, tokens = Eagle3KV(), []
        with torch.no_grad():
            logits, hidden = head(batch["embeds"][:, 1:], batch["features"][:, :-1], positions, kv)
            for step in range(3):
                token = head.draft_to_target(logits[:, -1].argmax(-1))
                tokens.append(int(token))
                embeds = m.token_embed(token[:, None])
                logits, hidden = head(embeds, hidden[:, -1:], positions[:, -1:] + 1 + step, kv)
        assert drafted[row].tolist() == tokens, row


# --------------------------------------------------------------------------------------------------------
# Lossless
@pytest.mark.parametrize("name", TINY_MODELS)
def test_eagle3_greedy_equals_autoregressive(name):
    """Every policy; 12 ragged prompts batched, 3 batched, 2 alone; drafts accepted and rejected."""
    m = target(name)
    path, prompts = head_dir(m), mixed_prompts(m)
    eos = m.config.eos_token_id
    base = DecodeConfig(max_new_tokens=20, draft_tokens=4, costs="estimated", drafter=path, eos_token_id=eos)
    ref = autoregressive(m, prompts, replace(base, **REFERENCE)).tokens
    for policy in POLICIES:
        cfg = replace(base, policy=policy)
        out = DECODERS["eagle3"](m, prompts, cfg)
        assert out.tokens == ref, policy
        assert out.oracle == out.accepted
        assert_drafted_and_accepted(out, policy)
        assert sum(out.drafted) > sum(out.accepted), policy  # rejections too
        assert DECODERS["eagle3"](m, prompts[:3], cfg).tokens == ref[:3], policy
        for i in (1, 9):
            assert DECODERS["eagle3"](m, [prompts[i]], cfg).tokens == [ref[i]], (policy, i)
    # On the text it learnt, the head's chains are right round after round: the rows it computes after each
    # verification read the features of the right positions (a shift by one drops this to 0.8 on tiny-llama).
    learnt = DECODERS["eagle3"](m, prompts[:8], base)
    assert learnt.tokens == ref[:8] and learnt.acceptance_rate > 0.9, learnt.acceptance_rate


def test_a_head_in_the_sglang_dialect_decodes_like_its_speculators_twin(tmp_path):
    """A SpecForge / SGLang directory (``midlayer.*``, a flat Llama config) drafts here: lossless, and the
    same drafts as the same head read from the speculators dialect."""
    m = target("tiny-llama")
    head = train_head(m, norm_before_residual=False)  # the layer SGLang runs: exported in both dialects
    path = save_eagle3(head, head.config, tmp_path / "head", verifier_name="tiny")
    assert (path / "sglang" / "config.json").is_file()
    prompts = mixed_prompts(m)
    base = DecodeConfig(max_new_tokens=16, draft_tokens=3, costs="estimated", policy="constant")
    ref = autoregressive(m, prompts, replace(base, **REFERENCE)).tokens
    speculators = DECODERS["eagle3"](m, prompts, replace(base, drafter=str(path)))
    sglang = DECODERS["eagle3"](m, prompts, replace(base, drafter=str(path / "sglang")))
    assert sglang.tokens == ref and sglang.accepted == speculators.accepted
    learnt = DECODERS["eagle3"](m, prompts[:8], replace(base, drafter=str(path / "sglang")))
    assert learnt.acceptance_rate > 0.9, learnt.acceptance_rate  # prompts[:8]: text the head learnt


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_padded_verification_changes_no_token_and_no_feature(engine, monkeypatch):
    """Verifications run longer than the draft (``CostModel.run_length``, copies of the last draft after it):
    output equal to autoregressive decoding, alone and chained, and the head's rows still read the features
    of the right positions (its chains on the text it learnt stay right: > 0.9 accepted)."""
    seen = padded_verification(monkeypatch)
    m = target("tiny-llama")
    path, prompts = head_dir(m), mixed_prompts(m)
    base = DecodeConfig(max_new_tokens=16, draft_tokens=3, costs="estimated", drafter=path, **ENGINES[engine])
    ref = autoregressive(m, prompts, replace(base, **REFERENCE)).tokens
    for chain in (False, True):
        out = DECODERS["eagle3"](m, prompts, replace(base, chain=chain, policy="constant"))
        assert out.tokens == ref, chain
    learnt = DECODERS["eagle3"](m, prompts[:8], replace(base, policy="constant"))
    assert learnt.tokens == ref[:8] and learnt.acceptance_rate > 0.9, learnt.acceptance_rate
    assert {(t, run) for t, run in seen} >= {(4, 6), (2, 4)}  # drafts of 3, and shorter ones near the end


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_eagle3_and_its_chain_on_every_execution_path(engine):
    m = target("tiny-qwen2")
    path, prompts = head_dir(m), mixed_prompts(m)
    base = DecodeConfig(max_new_tokens=16, draft_tokens=3, costs="estimated", drafter=path, **ENGINES[engine])
    ref = autoregressive(m, prompts, replace(base, **REFERENCE)).tokens
    for chain, trial in ((False, 16), (True, 0), (True, 1)):  # alone, a chain never retired, one retired
        out = DECODERS["eagle3"](
            m, prompts, replace(base.with_options(LookupOptions(fallback_trial=trial)), chain=chain)
        )
        assert out.tokens == ref, (chain, trial)
        assert_drafted_and_accepted(out, chain, trial)
        if chain and not trial:  # the head's own drafts were accepted in the chain, beside the lookup's
            assert out.by_proposer["eagle3"][0] > 0, out.by_proposer


@pytest.mark.parametrize("chain", [False, True])
def test_eagle3_sampling_matches_the_target_distribution(tmp_path, chain):
    """4000 rows of one prompt, 4 new tokens: drafts drawn from the head's distribution over its draft
    vocabulary (6 of the 8 tokens) are accepted by the lossless rule (in a chain, rows the lookup matches
    draft its tokens, q one-hot); every adjacent pair's distribution matches the target's exactly computed
    one."""
    m = tiny_vocab_model()
    head = random_tiny_vocab_head(m, tmp_path)
    prompt, samples = [3, 1, 4, 1, 5], 4000
    cfg = DecodeConfig(
        max_new_tokens=4,
        temperature=1.0,
        draft_tokens=3,
        seed=3,
        costs="estimated",
        drafter=head,
        chain=chain,
    ).with_options(LookupOptions(fallback_trial=0))
    joint = exact_joint(m, prompt, 4, cfg)
    out = DECODERS["eagle3"](m, [prompt] * samples, cfg)
    accepted, drafted = sum(out.accepted), sum(out.drafted)
    assert accepted > 100 and drafted - accepted > 100  # both the accept and the residual paths were taken
    if chain:
        assert out.by_proposer["eagle3"][1] > 100 and out.by_proposer["prompt_lookup"][1] > 100
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3


# --------------------------------------------------------------------------------------------------------
# Bad input
def test_eagle3_refuses_a_missing_a_foreign_or_a_damaged_head(tmp_path, monkeypatch):
    m = target("tiny-llama")
    prompts = [[5, 6, 7]]
    cfg = DecodeConfig(max_new_tokens=4)
    with pytest.raises(ConfigError, match="needs decoder.drafter"):
        DECODERS["eagle3"](m, prompts, cfg)
    small = tiny_vocab_model()
    foreign = Eagle3Head(Eagle3Config.from_target(small.config, draft_vocab_size=8, aux_layer_ids=[0, 1, 1]))
    save_eagle3(foreign, foreign.config, tmp_path / "foreign", verifier_name="small")
    with pytest.raises(ConfigError, match="target hidden size 32, but this model has 64"):
        DECODERS["eagle3"](m, prompts, replace(cfg, drafter=str(tmp_path / "foreign")))
    damaged = tmp_path / "damaged"
    head = train_head(m, steps=1)
    save_eagle3(head, head.config, damaged, verifier_name="tiny")
    (damaged / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(Eagle3FileError, match="damaged"):
        DECODERS["eagle3"](m, prompts, replace(cfg, drafter=str(damaged)))
    with pytest.raises(Eagle3FileError, match="no such file"):
        DECODERS["eagle3"](m, prompts, replace(cfg, drafter=str(tmp_path / "nowhere")))

    def no_load(*args, **kwargs):
        raise AssertionError("the weights loaded before the head directory was checked")

    monkeypatch.setattr(api, "load_model", no_load)
    with pytest.raises(Eagle3FileError, match="no such file"):
        api.from_pretrained("tiny-llama", device="cpu", drafter=str(tmp_path / "nowhere"))


# --------------------------------------------------------------------------------------------------------
# The library call and auto
def test_generate_drafts_with_the_head_and_auto_plans_it_from_its_record(tmp_path):
    """``generate(method="eagle3", drafter=PATH)`` is lossless; with ``<PATH>/acceptance.json`` recording the
    head's acceptance, ``auto`` prices it (one head forward per drafted token) and runs it, chained after
    prompt lookup."""
    m = target("tiny-llama")
    path = tmp_path / "head"
    shutil.copytree(head_dir(m), path)
    fd = FastDecoder(m.hf, tiny_model("tiny-llama")[1], m=m)
    prompts = mixed_prompts(m)[:4]
    ref = autoregressive(
        m, prompts, DecodeConfig(max_new_tokens=12, eos_token_id=m.config.eos_token_id)
    ).tokens
    result = fd.generate(prompts, max_new_tokens=12, method="eagle3", drafter=str(path), costs="estimated")
    assert result.ids == ref and result.method == "eagle3"
    assert_drafted_and_accepted(result.output)
    assert all(c.method != "eagle3" for c in fd.plan(1, costs="estimated", drafter=str(path)).candidates)
    rounds = {1: 1.97, 2: 2.9, 3: 3.8, 4: 4.7, 5: 5.5, 6: 6.3}
    write_record(path, AcceptanceRecord([DrafterRecord("eagle3", 0.97, tokens_per_round=rounds)]))
    fd = FastDecoder(m.hf, tiny_model("tiny-llama")[1], m=m)  # a new one: plans are kept per decoder
    plan = fd.plan(1, costs="estimated", drafter=str(path))
    assert plan.best.method == "eagle3" and plan.best.options["drafter"] == str(path), plan
    assert plan.best.options["chain"] is True
    auto = fd.generate(prompts, max_new_tokens=12, method="auto", drafter=str(path), costs="estimated")
    assert auto.ids == ref and auto.method == "eagle3"
    assert auto.output.by_proposer["eagle3"][0] > 0


def test_a_drafted_token_costs_one_head_forward_timed_once_per_head_shape(monkeypatch):
    m = target("tiny-llama")
    head = load_head(head_dir(m), m)
    estimated = estimate_costs(m)
    by_weights = head_token_cost(estimated, m, head)
    assert estimated.layers(1) < by_weights < 1.0  # more than a block of the target (fc + layer), < a step
    calls = []

    def timer(name, fn, device):
        fn()
        calls.append(name)
        return {("eagle3_draft",): 0.002, ("step",): 0.01}[name]

    monkeypatch.setattr(eagle3_kind, "timed", timer)
    # the head priced against a plain step timed in the same measurement, never against a stored step
    measured = replace(estimated, source="measured", step_seconds=123.0, batch=3)
    assert head_token_cost(measured, m, head) == pytest.approx(0.2)
    assert len(calls) == 2 * (eagle3_kind.HEAD_REPEATS + 1)
    assert head_token_cost(measured, m, head) == pytest.approx(0.2) and len(calls) == 16  # kept on the model
    proposer = Eagle3Proposer(m, head, DecodeConfig(max_new_tokens=4), torch.Generator(), costs=measured)
    proposer.head_cost = 0.2
    # each round: the drafts, the verification, and one more head pass (the row of the verifier's token)
    assert proposer.round_cost(3) == pytest.approx(3 * 0.2 + measured.verify(4))


def test_a_chain_books_the_heads_passes_in_the_lookups_rows():
    """The head writes the kept tokens' rows in every round the lookup drafted (``ride_cost``, one head pass):
    the chain's judge books that cost against it, so a head that barely pays on its own rows is retired once
    enough lookup rounds have paid for keeping it up."""
    m = target("tiny-llama")
    cfg = DecodeConfig(max_new_tokens=8, chain=True, costs="estimated", drafter=head_dir(m))
    chain = PROPOSERS["eagle3"].proposer(m, random_prompts(1, seed=54), cfg, torch.Generator())
    ride = chain.fallback.ride_cost()
    assert ride == chain.fallback.token_cost() > 0
    own = Draft(torch.zeros(1, 1, dtype=torch.long), lengths=[1], sources=["eagle3"])
    for _ in range(16):  # its own rows: 2 tokens for round_cost(1) < 2 steps each: it pays
        chain.judge(own, Settled(accepted=[1], kept=[1], lengths=[1]))
    margin = chain.books.gained - chain.books.spent
    assert not chain.retired and margin > 0
    looked_up = Draft(torch.zeros(1, 2, dtype=torch.long), lengths=[2], sources=["prompt_lookup"])
    rounds = 0
    while not chain.retired:
        chain.judge(looked_up, Settled(accepted=[2], kept=[2], lengths=[2]))
        rounds += 1
    assert chain.books.judged == 16 and rounds == math.floor(margin / ride) + 1


def test_the_speed_benchmark_hands_its_drafter_to_the_eagle3_method(tmp_path):
    base = ("decoder=[eagle3]", "model=tiny-llama", "baseline=null", "hf_baseline=null")
    with pytest.raises(ConfigError, match="pass drafter=PATH"):
        speed_plan(speed_cfg(*base))
    path = random_head_dir(tmp_path)
    _, methods, _ = speed_plan(speed_cfg(*base, f"drafter={path}"))
    assert methods[0].options["drafter"] == path
    with pytest.raises(Eagle3FileError, match="no such file"):  # before any model loads
        speed_plan(speed_cfg(*base, f"drafter={tmp_path / 'nowhere'}"))
