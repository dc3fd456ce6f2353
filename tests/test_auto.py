"""What ``auto`` rests on, each tested where it can fail: the acceptance a checkpoint records is what decoding
sees (the replay equals self-speculation round for round), the adaptive policy of a chain learns from its
fallback's rows only, prompt lookup cuts a batch at one width, a retired draft model stops running, a chain
runs the settings it was priced at, suffix decoding over a corpus is not priced as prompt lookup, and a result
says when its chain's fallback was retired."""

from __future__ import annotations

import pytest
import torch

from fastdecode.api import FastDecoder
from fastdecode.bench.report import auto_line
from fastdecode.decoding.chain import Books, ChainProposer, carrying
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.kinds import PlanInputs
from fastdecode.decoding.policies import Adaptive
from fastdecode.drafters.lookup.ngram import PromptLookupProposer
from fastdecode.drafters.lookup.options import LookupOptions
from fastdecode.plan.acceptance import AcceptanceRecord, DrafterRecord, replay_rounds
from fastdecode.plan.choose import LOOKUP_PRIOR, MAX_DRAFT, Plan, plan_decoding, price, ranked, with_corpus
from fastdecode.plan.cost import CostModel
from fastdecode.registry import DECODERS, PROPOSERS
from fastdecode.reports.exits import generation_report
from fastdecode.runtime.model import EarlyExitModel
from recipes.speed import speed_table
from tests.helpers import assisted_target, draft_model, lively_model, random_prompts, tiny_model

autoregressive = DECODERS["autoregressive"]


def test_replay_counts_rounds_as_greedy_speculation_does():
    """By hand: matches 1,1,0,1 after the prefill's token; K=2 accepts 2 (+1), then the mismatch (+1)."""
    seq = [True, True, True, False, True, True]  # token 0 comes from the prefill
    # K=1: rounds at 1 (accept 1, emit 2), 3 (reject, emit 1), 4 (accept 1: the budget leaves 1 draft, emit 2)
    assert replay_rounds([seq], 2)[1] == pytest.approx(5 / 3)
    # K=2: rounds at 1 (accept 2, emit 3: tokens 1..3, token 3 the correction), 4 (accept 1 by the budget, emit 2)
    assert replay_rounds([seq], 2)[2] == pytest.approx(5 / 2)
    assert replay_rounds([[True]], 3) == {1: 1.0, 2: 1.0, 3: 1.0}  # nothing after the prefill: no round


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
def test_the_recorded_rounds_are_what_self_speculation_does(exit_layer):
    """The record's ``tokens_per_round`` (replayed from the exit's agreement on the model's own greedy
    answers) equals the tokens per round of real greedy self-speculation at every K, prompt by prompt."""
    m = lively_model("tiny-llama", 0.3)
    prompts = random_prompts(4, seed=11)
    answers = autoregressive(m, prompts, DecodeConfig(max_new_tokens=24)).tokens
    report = generation_report(m, [(p + a, len(p)) for p, a in zip(prompts, answers, strict=True)])
    assert 0.1 < report["agreement"][exit_layer] < 0.95  # the premise: some drafts land, some do not
    for k in (1, 2, 4):
        cfg = DecodeConfig(max_new_tokens=24, exit_layer=exit_layer, policy="constant", draft_tokens=k)
        tokens = rounds = 0
        for prompt, answer in zip(prompts, answers, strict=True):
            out = DECODERS["self_speculative"](m, [prompt], cfg)
            assert out.tokens == [answer]
            tokens, rounds = tokens + len(answer) - 1, rounds + out.steps
        assert report["tokens_per_round"][exit_layer][k] == pytest.approx(tokens / rounds), k


def test_the_adaptive_policy_of_a_chain_learns_from_its_fallbacks_rows_only(monkeypatch):
    """Rounds the lookup drafted (absorbed, or forced rows) are not booked against the exit's confidences,
    and no round is booked against an earlier round's confidences."""
    booked = []
    real = Adaptive.update

    def spy(self, accepted, drafted):
        booked.append((list(accepted), len(self.confidences)))
        return real(self, accepted, drafted)

    monkeypatch.setattr(Adaptive, "update", spy)
    sources = []
    real_update = ChainProposer.update
    monkeypatch.setattr(
        ChainProposer,
        "update",
        lambda self, r, d, v, done: sources.append(list(done.sources)) or real_update(self, r, d, v, done),
    )
    m = EarlyExitModel(tiny_model("tiny-llama")[0])  # repeats its token: the lookup matches most rounds
    prompts = random_prompts(3, seed=52)
    cfg = DecodeConfig(max_new_tokens=20, exit_layer=2, chain=True, policy="adaptive", draft_tokens=4)
    out = DECODERS["self_speculative"](m, prompts, cfg)
    assert out.tokens == autoregressive(m, prompts, DecodeConfig(max_new_tokens=20)).tokens
    assert out.by_proposer["prompt_lookup"][0] > 0 and len(booked) == len(sources)
    lookup_rounds = 0
    for (accepted, confidences), round_sources in zip(booked, sources, strict=True):
        for a, source in zip(accepted, round_sources, strict=True):
            assert (a is None) == (source != "exit"), (accepted, round_sources)
        if all(s != "exit" for s in round_sources):
            lookup_rounds += 1
            assert confidences == 0  # begun afresh: nothing left from the exit's last draft
    assert lookup_rounds > 0


def test_prompt_lookup_cuts_a_batch_at_one_width():
    """A verification is as wide as the batch's longest draft: once one row's confident match sets the width,
    another row's weaker match rides along for free, and the width is what pays for the batch as a whole."""
    costs = CostModel(
        30, 1000, (1, 2, 3, 5), (0.03, 0.04, 0.05, 0.07), (0.1, 0.1, 0.1, 0.1), "measured", batch=2
    )
    cfg = DecodeConfig(max_new_tokens=50, policy="adaptive").with_options(LookupOptions(max_ngram_size=4))
    strong = [7, 8, 9, 10, 1, 2, 3, 4, 5, 7, 8, 9, 10]  # (7, 8, 9, 10) seen before: 1, 2, 3, 4 follow
    weak = [5, 1, 2, 6, 6, 6, 3, 1]  # only (1,) seen before: a 1-token match, 2, 6, 6, 6 follow
    proposer = PromptLookupProposer([strong, weak], cfg, costs, 1000)
    proposer.policy = Adaptive(4)
    from fastdecode.decoding.common import Rows
    from fastdecode.decoding.speculative import Round

    rows = Rows(2, cfg)
    r = Round(
        torch.tensor([10, 1]), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool), 4, rows, 0
    )
    drafts = proposer.lookup(r)
    assert drafts[0] == [1, 2, 3] and drafts[1] == [2, 6, 6]  # one width (3 pays best) for both rows
    for prompt, wanted in ((strong, [1, 2, 3, 4]), (weak, [])):  # alone, each row is cut where it pays
        alone = PromptLookupProposer([prompt], cfg, costs, 1000)
        alone.policy = Adaptive(4)
        last = torch.tensor([prompt[-1]])
        solo = Round(
            last, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool), 4, Rows(1, cfg), 0
        )
        assert alone.lookup(solo)[0] == wanted


def test_a_retired_draft_model_stops_running(monkeypatch):
    """A separate draft model that does not pay is retired by the chain's judge; from then on the draft model
    runs no forward at all (its cache is no longer kept), and decoding stays lossless."""
    target, small = assisted_target(), draft_model("other")
    calls = []
    real = small.run_layers
    monkeypatch.setattr(small, "run_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = random_prompts(2, seed=5)
    cfg = DecodeConfig(max_new_tokens=40, chain=True, draft_tokens=3).with_options(
        LookupOptions(fallback_trial=2)
    )
    retired = []
    real_retire = ChainProposer.judge

    def judge(self, draft, done):
        real_retire(self, draft, done)
        retired.append((self.retired, len(calls)))

    monkeypatch.setattr(ChainProposer, "judge", judge)
    out = DECODERS["assisted"](target, prompts, cfg, draft=small)
    assert out.tokens == autoregressive(target, prompts, DecodeConfig(max_new_tokens=40)).tokens
    first = next(i for i, (done, _) in enumerate(retired) if done)
    assert calls and len(calls) == retired[first][1]  # no draft-model forward after the retirement
    assert out.steps > first + 3  # and decoding went on for several rounds


def test_every_planned_kind_is_a_chainable_or_standalone_decoder():
    """The registry: every kind is a decoder of its name; the ones ``auto`` chains can follow the lookup."""
    for name, kind in PROPOSERS.items():
        assert DECODERS[name].__wrapped__ == kind.generate and kind.name == name  # held under the model lock
    assert {n for n, k in PROPOSERS.items() if k.chainable} == {
        "self_speculative",
        "assisted",
        "eagle3",
        "dflash",
    }
    with pytest.raises(Exception, match="cannot follow prompt lookup"):
        DECODERS["prompt_lookup"](
            lively_model("tiny-llama"), [[5, 6]], DecodeConfig(max_new_tokens=3, chain=True)
        )


def test_a_chains_judge_carries_its_books_across_calls():
    """``generate(method="auto")`` keeps a planned chain's books (``carrying``): a fallback retired in one call
    starts the next with that evidence (decayed), so it costs a few trial rounds, not the whole trial again;
    decoding stays lossless."""
    m = lively_model("tiny-llama")  # upper layers at full strength: exit 1 rarely agrees with the output
    prompts = random_prompts(2, seed=53)
    cfg = DecodeConfig(
        max_new_tokens=40, exit_layer=1, chain=True, draft_tokens=3, costs="estimated"
    ).with_options(LookupOptions(fallback_trial=8))
    ref = autoregressive(m, prompts, DecodeConfig(max_new_tokens=40)).tokens
    books = Books()
    rounds = []
    for _ in range(3):
        with carrying(books):
            out = DECODERS["self_speculative"](m, prompts, cfg)
        assert out.tokens == ref
        rounds.append(out.by_proposer.get("exit", [0, 0, 0])[2])
        assert books.against(8)  # retired, on the evidence
    assert rounds[0] >= 8 and all(r < rounds[0] / 2 for r in rounds[1:])
    alone = DECODERS["self_speculative"](m, prompts, cfg)  # no books carried: the whole trial again
    assert alone.by_proposer["exit"][2] == rounds[0]


# a GPU-like cost model (memory-bound: a verification costs one step at any width) of a 30-layer model
GPU = CostModel(30, 1000, (1,), (0.03,), (0.1,), "estimated")


def sure_exit(exit_layer: int = 3, acceptance: float = 0.99) -> AcceptanceRecord:
    """A record whose exit drafts so well on GPU costs that a longer draft always pays more: priced over K up
    to ``MAX_DRAFT``, its best K is the longest."""
    return AcceptanceRecord([DrafterRecord("exit", acceptance, exit_layer)])


def test_a_planned_chain_runs_the_settings_it_was_priced_at():
    """The chain is priced with ``LOOKUP_PRIOR`` (measured with the adaptive cut at up to ``limit`` drafts) and
    its fallback at its best constant K of what the chain may draft: it runs adaptive at up to that same bound,
    says so, and never drafts past it."""
    m = lively_model("tiny-llama")
    record = sure_exit()
    plan = plan_decoding(m, GPU, record=record)
    chain, lookup = plan.best, plan.candidates[-1]
    bound = LOOKUP_PRIOR.limit
    assert chain.options["chain"] is True and chain.options["policy"] == "adaptive"
    assert chain.options["draft_tokens"] == bound == lookup.options["draft_tokens"] < MAX_DRAFT
    (offer,) = PROPOSERS["self_speculative"].offers(PlanInputs(m, GPU, record, None, None))
    assert price(offer, GPU)[0] == MAX_DRAFT  # unbounded, the fallback would be priced at K=8
    k, alone = price(offer, GPU, bound)
    assert chain.draft == k == bound
    assert chain.expected_speedup == pytest.approx(
        LOOKUP_PRIOR.speedup(GPU, fallback=alone, ride=offer.ride_cost)
    )
    assert f"K={k} of 1..{bound}" in chain.reason and f"up to {bound} drafts" in chain.reason
    assert f"up to {bound} drafts" in lookup.reason
    prompts = random_prompts(3, seed=7)
    cfg = DecodeConfig(max_new_tokens=30, costs="estimated", **chain.options)
    out = DECODERS[chain.method](m, prompts, cfg)
    assert out.tokens == autoregressive(m, prompts, DecodeConfig(max_new_tokens=30)).tokens
    assert out.drafted and max(out.drafted) <= bound


def test_suffix_decoding_over_a_corpus_is_not_priced_as_prompt_lookup():
    """No prior is recorded for suffix decoding over a corpus: ``with_corpus`` leaves its candidates without an
    expected speedup, says why, ranks them after the priced ones, and every report prints them."""
    plan = plan_decoding(lively_model("tiny-llama"), GPU, record=sure_exit())
    found = [with_corpus(c, "c.sfx") for c in plan.candidates]
    assert [c.name for c in found] == ["suffix+exit", "suffix"]
    for candidate in found:
        assert candidate.expected_speedup is None and "no prior is recorded" in candidate.reason
    priced = plan.candidates[0]
    order = ranked([found[1], priced, found[0]])  # the priced first; the others as they came
    assert [c.name for c in order] == ["prompt_lookup+exit", "suffix", "suffix+exit"]
    corpus = Plan(found, plan.not_paying)
    line = auto_line({"plan": corpus.to_json(), "summary": []})
    assert "auto planned suffix+exit (no prior recorded), suffix (no prior recorded)" in line
    timed = {"speedup": 1.2, "tokens_per_s": 10.0}
    result = {"autoregressive": {"tokens_per_s": 8.0}, "decoders": {c.name: timed for c in found}}
    assert "| suffix (auto) | suffix | - | - | - | 1.20x | 10.0 |" in speed_table(
        result, Plan([found[1]], [])
    )


def test_a_result_says_its_chains_fallback_was_retired_from_the_start():
    """``auto`` plans an exit its record overstates; the chain's judge retires it in the first call, and the
    books carried over start the next call with it retired: that result says the first stage ran alone."""
    m = lively_model("tiny-llama")  # upper layers at full strength: exit 1 rarely agrees with the output
    fd = FastDecoder(m.hf, tiny_model("tiny-llama")[1], record=sure_exit(1), m=m)
    prompts = random_prompts(6, seed=53)
    options = dict(max_new_tokens=24, costs="estimated", lookup={"fallback_trial": 2})
    ref = fd.generate(prompts, method="autoregressive", max_new_tokens=24).ids
    first = fd.generate(prompts, **options)
    assert first.candidate.name == "prompt_lookup+exit" and first.ids == ref
    assert first.output.fallback_retired >= 1 and first.output.by_proposer["exit"][2] > 0
    assert (
        first.ran == f"prompt_lookup+exit, its fallback retired after round {first.output.fallback_retired}"
    )
    second = fd.generate(prompts, **options)
    assert (
        second.ids == ref and second.output.fallback_retired == 0 and "exit" not in second.output.by_proposer
    )
    assert "retired from the start" in second.ran and "retired from the start" in repr(second)
    plain = fd.generate(prompts, method="prompt_lookup", max_new_tokens=24)
    assert plain.output.fallback_retired is None and plain.ran == "prompt_lookup"
