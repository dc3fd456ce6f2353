"""Proposers (fastdecode/decoding/proposers.py, ngram.py, lookahead.py): each owns its vocabulary and its
cost; prompt lookup, lookahead and the chains are lossless (greedy = autoregressive on every family, policy
and batch size, ragged batches included; sampling matches the target's distribution); n-gram lookups find
what the reference finds."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from fastdecode.config import ConfigError
from fastdecode.decoding.chain import ChainProposer
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.policies import POLICIES
from fastdecode.decoding.speculative import Draft, Settled, Verdict
from fastdecode.drafters.draft_model.proposer import DraftModelProposer
from fastdecode.drafters.exits.adapter import save_adapter
from fastdecode.drafters.exits.proposer import ExitProposer
from fastdecode.drafters.lookup.lookahead import LookaheadProposer
from fastdecode.drafters.lookup.ngram import NgramIndex, PromptLookupProposer
from fastdecode.drafters.lookup.options import LookupOptions
from fastdecode.files.draft_vocab_file import save_draft_vocab
from fastdecode.plan.cost import CostModel, block_parameters, estimate_costs, exit_draft_cost
from fastdecode.registry import DECODERS, PROPOSERS
from fastdecode.runtime.model import EarlyExitModel
from tests.conftest import ENGINES, REFERENCE, TINY_MODELS
from tests.helpers import (
    assert_drafted_and_accepted,
    assisted_target,
    draft_model,
    exact_joint,
    lively_model,
    padded_verification,
    pair_pvalues,
    perturbed_adapter,
    random_prompts,
    tiny_model,
    tiny_vocab_model,
)

autoregressive = DECODERS["autoregressive"]


# --------------------------------------------------------------------------------------------------------
# N-gram lookups
def test_ngram_index_finds_the_most_recent_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex(3)
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3])
    # Suffix (1, 2, 3) occurred at 0 (then 9) and at 4 (then 7): the most recent wins, up to the limit.
    assert index.lookup(1, 3) == ([7, 5, 1], 3)
    assert index.lookup(1, 10) == ([7, 5, 1, 2, 3], 3)  # never past the current end
    index.extend([4])  # (2, 3, 4) and (3, 4) never occurred; (4,) never either: no match
    assert index.lookup(1, 3) == ([], 0)
    index.extend([8, 3])  # (8, 3) is new, (3,) occurred last before 4 (at 11)
    assert index.lookup(1, 3) == ([4, 8, 3], 1)
    assert index.lookup(2, 3) == ([], 0)  # min_n = 2: a 1-token match does not count
    alone = NgramIndex(2)
    alone.extend([5])
    assert alone.lookup(1, 4) == ([], 0)  # a row's own last token is not an earlier occurrence


def _round(rows_tokens, prompts, limit):
    """A Round for proposer unit tests (host lists only matter to n-gram proposers)."""
    from fastdecode.decoding.common import Rows
    from fastdecode.decoding.speculative import Round

    rows = Rows(len(prompts), DecodeConfig(max_new_tokens=50))
    rows.tokens[:] = [list(t) for t in rows_tokens]
    last = torch.tensor([t[-1] for t in rows_tokens])
    return Round(
        last,
        torch.zeros(len(prompts), dtype=torch.long),
        torch.ones(len(prompts), dtype=torch.bool),
        limit,
        rows,
        0,
    )


def test_prompt_lookup_drafts_per_row_cuts_at_eos_and_learns_what_pays():
    m = lively_model("tiny-llama")
    cfg = DecodeConfig(max_new_tokens=50, eos_token_id=99).with_options(
        LookupOptions(max_ngram_size=2, eos="after")
    )
    costs = estimate_costs(m)
    prompts = [[10, 11, 12, 99, 13, 14], [20, 21, 22]]
    proposer = PromptLookupProposer(prompts, cfg, costs, m.vocab_size)
    proposer.policy = POLICIES["constant"](4)
    draft = proposer.propose(_round([[10, 11], [5]], prompts, 4))
    # Row 0: "10 11" occurred before, followed by 12, 99 (EOS: the draft stops there); row 1: no match.
    assert draft.lengths == [2, 0] and draft.tokens[0, :2].tolist() == [12, 99]
    default = PromptLookupProposer(prompts, cfg.with_options(LookupOptions(max_ngram_size=2)), costs, 261)
    default.policy = POLICIES["constant"](4)
    assert default.propose(_round([[10, 11], [5]], prompts, 4)).lengths == [1, 0]  # cut before the EOS
    assert proposer.token_cost() == 0.0 and proposer.vocab is None and proposer.depth == 0
    assert proposer.round_cost(2) == pytest.approx(costs.verify(3))
    # The cost-aware policy, on a CPU-like cost model (verifying 2 tokens costs 1.13 steps), drafts while the
    # prior says half the drafts land, and stops where the drafts it has seen were always rejected.
    cpu = CostModel(4, m.vocab_size, (1, 2, 3), (0.2, 0.23, 0.25), (0.2, 0.21, 0.22), "measured")
    assert cpu.verify(2) == pytest.approx(1.13)
    proposer = PromptLookupProposer(prompts, cfg, cpu, m.vocab_size)
    proposer.policy = POLICIES["adaptive"](4, marginal=[0.3] * 4)
    assert proposer.propose(_round([[10, 11], [5]], prompts, 4)).lengths == [2, 0]
    for _ in range(30):
        proposer.stats.add(2, 0, 2)
    assert proposer.propose(_round([[10, 11], [5]], prompts, 4)).lengths == [0, 0]


# --------------------------------------------------------------------------------------------------------
# Each proposer owns its vocabulary and its cost
def test_every_proposer_reports_its_vocabulary_and_cost(tmp_path):
    m = lively_model("tiny-llama", 0.1)
    costs = estimate_costs(m)
    prompts = random_prompts(2, seed=1)
    gen = torch.Generator()
    cfg = DecodeConfig(max_new_tokens=8, exit_layer=2, costs="estimated")
    raw = PROPOSERS["self_speculative"].proposer(m, prompts, cfg, gen)
    assert isinstance(raw, ExitProposer) and raw.vocab is None and raw.depth == 2
    assert raw.token_cost() == pytest.approx(costs.draft_token(2))
    # A raw exit with a draft vocabulary file scores those rows only.
    save_draft_vocab(tmp_path / "vocab.json", torch.arange(30), vocab_size=m.vocab_size)
    sub = PROPOSERS["self_speculative"].proposer(
        m, prompts, replace(cfg, draft_vocab=str(tmp_path / "vocab.json")), gen
    )
    assert sub.vocab.tolist() == list(range(30))
    assert sub.token_cost() == pytest.approx(costs.draft_token(2, head_rows=30))
    # An exit adapter drafts over its own draft vocabulary (not the full head), its weights counted.
    adapter = perturbed_adapter(m, 2, "block")
    path = str(save_adapter(adapter, tmp_path / "E2", m, vocab=torch.arange(5, 45)))
    through = PROPOSERS["self_speculative"].proposer(
        m, prompts, replace(cfg, exit_layer=None, adapter=path), gen
    )
    assert through.name == "adapter" and through.vocab.tolist() == list(range(5, 45))
    expected = exit_draft_cost(costs, m, 2, adapter=through.adapter, vocab=through.vocab)
    assert through.token_cost() == pytest.approx(expected)
    assert expected < costs.draft_token(2, extra_blocks=adapter.num_parameters() / block_parameters(m))
    chain = PROPOSERS["self_speculative"].proposer(
        m, prompts, replace(cfg, exit_layer=None, adapter=path, chain=True), gen
    )
    assert isinstance(chain, ChainProposer) and torch.equal(chain.vocab, through.vocab)
    assert chain.token_cost() == pytest.approx(expected) and chain.name == "prompt_lookup+adapter"
    # A draft model: its own step in the target's unit, by weights read when estimated.
    target, small = assisted_target(), draft_model("other")
    two = DraftModelProposer(
        small, cfg, gen, costs=estimate_costs(target), draft_costs=estimate_costs(small), target=target
    )
    ratio = small.step_cost() / target.step_cost()
    assert two.vocab is None and two.token_cost() == pytest.approx(ratio) and 0 < ratio < 0.25
    lookahead = LookaheadProposer(prompts, cfg, costs, m.vocab_size)
    assert lookahead.vocab is None and lookahead.token_cost() == 0.0


def test_drafting_through_an_adapter_scores_only_its_own_vocabulary(tmp_path, monkeypatch):
    """The adapter's draft head: every drafted logit row is over the adapter's vocabulary (a decoder that
    dropped it would score the full head and still be lossless, so equality tests cannot see it)."""
    m = lively_model("tiny-llama", 0.1)
    vocab = torch.arange(5, 45)
    path = str(save_adapter(perturbed_adapter(m, 2, "block"), tmp_path / "E2", m, vocab=vocab))
    seen, original = [], EarlyExitModel.exit_logits_subset

    def spy(self, hidden, ids):
        seen.append(ids.tolist())
        return original(self, hidden, ids)

    monkeypatch.setattr(EarlyExitModel, "exit_logits_subset", spy)
    prompts = random_prompts(3, seed=2)
    DECODERS["self_speculative"](m, prompts, DecodeConfig(max_new_tokens=12, adapter=path))
    assert seen and all(ids == vocab.tolist() for ids in seen)  # the cost model timed the same head
    seen.clear()
    out = DECODERS["self_speculative"](m, prompts, DecodeConfig(max_new_tokens=12, adapter=path))
    assert out.tokens == autoregressive(m, prompts, DecodeConfig(max_new_tokens=12)).tokens
    assert seen and all(ids == vocab.tolist() for ids in seen) and len(seen) == sum(out.drafted) // 3


# --------------------------------------------------------------------------------------------------------
# Lossless: greedy output equals autoregressive
NEVER_RETIRED = LookupOptions(fallback_trial=0)  # a chain whose fallback drafts to the end
N_GRAM_DECODERS = {
    "prompt_lookup": ("prompt_lookup", {}),
    "lookahead": ("lookahead", {}),
    "chain_exit": (
        "self_speculative",
        {"exit_layer": 2, "chain": True, "groups": {"lookup": LookupOptions(fallback_trial=0)}},
    ),
    "chain_exit_retiring": (
        "self_speculative",
        {"exit_layer": 2, "chain": True, "groups": {"lookup": LookupOptions(fallback_trial=2)}},
    ),
}


@pytest.mark.parametrize("decoder", N_GRAM_DECODERS)
@pytest.mark.parametrize("name", TINY_MODELS)
def test_ngram_drafting_greedy_equals_autoregressive(name, decoder):
    """Every policy; 12 random prompts batched (ragged drafts and acceptance, holes), 3 batched, 2 alone; a
    model that repeats itself (long accepted runs) and one that does not (rejections)."""
    method, options = N_GRAM_DECODERS[decoder]
    for model in (EarlyExitModel(tiny_model(name)[0]), lively_model(name, 0.1)):
        prompts = random_prompts(12, seed=TINY_MODELS.index(name) + 40)
        # Estimated costs: the cost-aware policy's lengths do not depend on timings of a tiny model here.
        base = DecodeConfig(
            max_new_tokens=20, draft_tokens=4, eos_token_id=model.config.eos_token_id, costs="estimated"
        )
        ref = autoregressive(model, prompts, replace(base, **REFERENCE)).tokens
        for policy in POLICIES:
            cfg = replace(base, policy=policy, **options)
            out = DECODERS[method](model, prompts, cfg)
            assert out.tokens == ref, (policy, decoder)
            assert DECODERS[method](model, prompts[:3], cfg).tokens == ref[:3], (policy, decoder)
            for i in (3, 4):
                assert DECODERS[method](model, [prompts[i]], cfg).tokens == [ref[i]], (policy, decoder, i)
            assert out.oracle == out.accepted
            assert_drafted_and_accepted(out, policy, decoder)


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_ngram_drafting_on_every_execution_path(engine):
    """A model that does not repeat itself (rejected drafts) and one that does (accepted runs): every decoder's
    drafts are accepted on one of them at least."""
    prompts = random_prompts(6, seed=50)
    base = DecodeConfig(max_new_tokens=16, draft_tokens=3, **ENGINES[engine])
    accepted = dict.fromkeys(N_GRAM_DECODERS, 0)
    for m in (lively_model("tiny-mistral", 0.1), EarlyExitModel(tiny_model("tiny-mistral")[0])):
        ref = autoregressive(m, prompts, replace(base, **REFERENCE)).tokens
        for name, (method, options) in N_GRAM_DECODERS.items():
            out = DECODERS[method](m, prompts, replace(base, **options))
            assert out.tokens == ref, name
            assert sum(out.drafted) > 0, name
            accepted[name] += sum(out.accepted)
    assert all(accepted.values()), accepted


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_padded_verification_equals_autoregressive(name, monkeypatch):
    """Verifications padded past the draft (``CostModel.run_length``) change no token: prompt lookup and a
    draft model, every policy, ragged batches (rows that accept fewer drafts leave holes before the padding)."""
    seen = padded_verification(monkeypatch)
    prompts = random_prompts(8, seed=44)
    for m in (EarlyExitModel(tiny_model(name)[0]), lively_model(name, 0.1)):
        base = DecodeConfig(max_new_tokens=16, draft_tokens=4, eos_token_id=m.config.eos_token_id)
        ref = autoregressive(m, prompts, replace(base, **REFERENCE)).tokens
        for policy in POLICIES:
            assert DECODERS["prompt_lookup"](m, prompts, replace(base, policy=policy)).tokens == ref, policy
    assert any(run > t for t, run in seen)
    target, draft = assisted_target(), draft_model("copy")
    cfg = DecodeConfig(max_new_tokens=12, draft_tokens=3)
    ref = autoregressive(target, prompts, replace(cfg, **REFERENCE)).tokens
    assert DECODERS["assisted"](target, prompts, cfg, draft=draft).tokens == ref


def test_chain_with_an_adapter_and_with_a_draft_model_equals_autoregressive(tmp_path):
    m = assisted_target()
    path = str(
        save_adapter(perturbed_adapter(m, 2, "attention"), tmp_path / "E2", m, vocab=torch.arange(261))
    )
    prompts = random_prompts(8, seed=51)
    base = DecodeConfig(max_new_tokens=20, draft_tokens=4, chain=True)
    ref = autoregressive(m, prompts, DecodeConfig(max_new_tokens=20)).tokens
    for policy in POLICIES:
        through = DECODERS["self_speculative"](m, prompts, replace(base, adapter=path, policy=policy))
        assert through.tokens == ref, policy
        assert set(through.by_proposer) <= {"adapter", "prompt_lookup"} and "adapter" in through.by_proposer
        assert through.by_proposer["adapter"][0] > 0, policy  # the adapter's own drafts were accepted
        two = DECODERS["assisted"](m, prompts, replace(base, policy=policy), draft=draft_model("copy"))
        assert two.tokens == ref, policy
        assert two.by_proposer["draft_model"][0] > 0, policy


def test_a_chain_drafts_from_the_lookup_where_the_text_matches():
    """A model that repeats its token: the lookup matches every row from the second new token on, so the
    chain's rounds are prompt-lookup rounds (one forward through the exit's layers), and they are accepted."""
    m = EarlyExitModel(tiny_model("tiny-llama")[0])
    prompts = random_prompts(4, seed=52)
    cfg = DecodeConfig(max_new_tokens=16, exit_layer=2, chain=True, draft_tokens=4)
    out = DECODERS["self_speculative"](m, prompts, cfg)
    assert out.tokens == autoregressive(m, prompts, DecodeConfig(max_new_tokens=16)).tokens
    looked_up = out.by_proposer["prompt_lookup"]
    assert looked_up[1] > 0 and looked_up[0] / looked_up[1] > 0.9


def test_a_chain_retires_a_fallback_that_does_not_pay_on_the_text():
    """A random model's exit E=1 is rarely right: after ``fallback_trial`` of its row-rounds the chain has
    booked fewer tokens than steps and stops drafting through it (still lossless); with 0 it drafts on."""
    m = lively_model("tiny-llama")  # upper layers at full strength: exit 1 rarely agrees with the output
    prompts = random_prompts(2, seed=53)
    base = DecodeConfig(max_new_tokens=40, exit_layer=1, chain=True, draft_tokens=3, costs="estimated")
    ref = autoregressive(m, prompts, DecodeConfig(max_new_tokens=40)).tokens
    kept = DECODERS["self_speculative"](m, prompts, base.with_options(NEVER_RETIRED))
    retired = DECODERS["self_speculative"](m, prompts, base.with_options(LookupOptions(fallback_trial=4)))
    assert kept.tokens == ref and retired.tokens == ref
    exit_kept, exit_retired = kept.by_proposer["exit"], retired.by_proposer["exit"]
    assert exit_kept[0] / exit_kept[1] < 0.3  # the premise: its drafts rarely land
    assert exit_retired[2] < exit_kept[2] / 2  # its row-rounds: about the trial


def test_the_chain_judges_the_fallback_by_the_cost_model():
    """Retired exactly when the fallback's rows yielded fewer tokens than their rounds cost."""
    m = lively_model("tiny-llama", 0.1)
    chain = PROPOSERS["self_speculative"].proposer(
        m,
        random_prompts(1, seed=54),
        DecodeConfig(max_new_tokens=8, exit_layer=1, chain=True, costs="estimated"),
        torch.Generator(),
    )
    cost = chain.fallback.round_cost(2)
    assert 1 < cost < 3
    draft = Draft(torch.zeros(1, 2, dtype=torch.long), lengths=[2], sources=["exit"])
    for _ in range(16):  # 2 accepted + 1 = 3 tokens for `cost` steps: it pays
        chain.judge(draft, Settled(accepted=[2], kept=[2], lengths=[2]))
    assert not chain.retired and chain.books.judged == 16
    for _ in range(64):  # nothing accepted: 1 token per `cost` steps
        chain.judge(draft, Settled(accepted=[0], kept=[0], lengths=[2]))
        if chain.retired:
            break
    assert chain.retired and chain.books.gained < chain.books.spent <= chain.books.gained + cost


# --------------------------------------------------------------------------------------------------------
# Lossless: sampling follows the target's distribution
@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("prompt_lookup", {"policy": "constant"}),
        ("prompt_lookup", {"policy": "adaptive", "top_k": 4}),
        ("lookahead", {"policy": "constant"}),
        (
            "self_speculative",
            {"exit_layer": 1, "chain": True, "policy": "constant", "groups": {"lookup": NEVER_RETIRED}},
        ),
        (
            "self_speculative",
            {"exit_layer": 1, "chain": True, "groups": {"lookup": LookupOptions(fallback_trial=1)}},
        ),
    ],
    ids=["lookup", "lookup-adaptive-topk", "lookahead", "chain", "chain-retired"],
)
def test_ngram_sampling_matches_the_target_distribution(method, options):
    """4000 rows of one prompt, 4 new tokens: drafts are deterministic (q one-hot), accepted with
    probability p(draft); every adjacent pair's distribution matches the target's exactly computed one."""
    m = tiny_vocab_model()
    prompt, samples = [3, 1, 4, 1, 5], 4000
    cfg = DecodeConfig(
        max_new_tokens=4, temperature=1.0, draft_tokens=3, seed=3, costs="estimated", **options
    )
    joint = exact_joint(m, prompt, 4, cfg)
    out = DECODERS[method](m, [prompt] * samples, cfg)
    accepted, drafted = sum(out.accepted), sum(out.drafted)
    assert accepted > 100 and drafted - accepted > 100  # both the accept and the residual paths were taken
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3


# --------------------------------------------------------------------------------------------------------
# Bad input
def test_ngram_decoders_refuse_what_they_cannot_do():
    m = lively_model("tiny-llama")
    with pytest.raises(
        ConfigError, match="'prompt_lookup' verifies with the whole model.*decoder.chain=true"
    ):
        DECODERS["prompt_lookup"](m, [[5, 6]], DecodeConfig(max_new_tokens=4, exit_layer=2))
    with pytest.raises(ConfigError, match="'lookahead' verifies with the whole model"):
        DECODERS["lookahead"](m, [[5, 6]], DecodeConfig(max_new_tokens=4, exit_layer=2))
    with pytest.raises(ConfigError, match="no separate draft model"):
        DECODERS["prompt_lookup"](m, [[5, 6]], DecodeConfig(max_new_tokens=4), draft=m)
    with pytest.raises(ConfigError, match="min_ngram_size=3, max_ngram_size=2"):
        LookupOptions(max_ngram_size=2, min_ngram_size=3)
    with pytest.raises(ConfigError, match="Unknown cost model 'fast'"):
        DecodeConfig(max_new_tokens=4, costs="fast")
    assert list(itertools.islice(DECODERS, 0, None)).count("prompt_lookup") == 1


# --------------------------------------------------------------------------------------------------------
# Lookahead's Jacobi pool (fastdecode/drafters/lookup/lookahead.py)
def test_the_lookahead_pool_keeps_the_verifiers_trajectory_and_drafts_from_it():
    """After a verification of [t, d1..d4] that accepted one draft, the pool holds, keyed by each token of the
    verifier's predictions from the correction on, the predictions that follow it; a row with no lookup match
    whose last token is a key drafts that n-gram (padded with the token: Jacobi's repeat guess)."""
    cfg = DecodeConfig(max_new_tokens=50, draft_tokens=4)
    proposer = LookaheadProposer([[30, 31, 32]], cfg, estimate_costs(lively_model("tiny-llama")), 261)
    proposer.policy = POLICIES["constant"](4)
    r = _round([[40]], [[30, 31, 32]], 4)
    draft = proposer.propose(r)
    assert draft.tokens.tolist() == [[40] * 4] and draft.sources == ["lookahead"]  # empty pool: repeat guess
    target = torch.tensor([[7, 8, 9, 10, 11]])  # the verifier's argmax at [t, d1..d4]
    verdict = Verdict(torch.tensor([1]), torch.tensor([8]), torch.tensor([1]), target)
    proposer.update(r, draft, verdict, Settled(accepted=[1], kept=[1], lengths=[4]))
    assert proposer.pools[0] == {8: [9, 10, 11], 9: [10, 11], 10: [11]}
    again = proposer.propose(_round([[40, 41, 8]], [[30, 31, 32]], 4))
    assert again.tokens.tolist() == [[9, 10, 11, 8]] and again.sources == ["lookahead"]


def test_lookahead_pool_drafts_are_proposed_and_accepted_in_decoding(monkeypatch):
    """Decoding random prompts: every row's pool fills with n-grams of the verifier's own predictions, and
    rounds that draft from the pool (no lookup match, the last token a key) get drafts accepted. A pool that
    stores nothing drafts only repeat guesses, and fails here."""
    rounds, pool_rounds = [], []
    propose, update = LookaheadProposer.propose, LookaheadProposer.update

    def spy_propose(self, r):
        last = r.last.tolist()
        entries = [list(self.pools[row].get(last[row], [])) for row in range(len(last))]
        draft = propose(self, r)
        rounds.append((entries, draft))
        return draft

    def spy_update(self, r, draft, verdict, done):
        entries = rounds[-1][0]
        for row, accepted in enumerate(done.accepted):
            if accepted is not None and draft.sources[row] == "lookahead" and entries[row]:
                guess = entries[row][: draft.row_lengths()[row]]  # the pool's n-gram, up to the round's limit
                assert draft.tokens[row, : len(guess)].tolist() == guess
                pool_rounds.append(accepted)
            if accepted is not None:  # what the pool may hold after this round: the verifier's trajectories
                trajectories[row].append(verdict.target[row, accepted : done.lengths[row] + 1].tolist())
        update(self, r, draft, verdict, done)
        pools.append(self.pools)

    monkeypatch.setattr(LookaheadProposer, "propose", spy_propose)
    monkeypatch.setattr(LookaheadProposer, "update", spy_update)
    m = lively_model("tiny-llama")
    prompts = random_prompts(6, seed=5)
    trajectories, pools = [[] for _ in prompts], []
    cfg = DecodeConfig(max_new_tokens=40, draft_tokens=4, policy="constant")
    out = DECODERS["lookahead"](m, prompts, cfg)
    assert out.tokens == autoregressive(m, prompts, DecodeConfig(max_new_tokens=40)).tokens
    for row, pool in enumerate(pools[-1]):
        assert len(pool) >= 10, row
        for key, tail in pool.items():  # each n-gram is a run of the verifier's predictions in one round
            gram = [key, *tail]
            assert any(gram == t[i : i + len(gram)] for t in trajectories[row] for i in range(len(t))), (
                row,
                gram,
            )
    assert len(pool_rounds) > 50 and sum(1 for a in pool_rounds if a > 0) >= 3
