"""Suffix decoding (fastdecode/drafters/suffix/proposer.py): lossless against autoregressive decoding (greedy token for
token, sampling in distribution) with the row, global and corpus indexes; drafts accepted where text repeats;
the global index bounded, per model and reset; bad options and damaged or foreign corpus files refused by
name before decoding; the tree drafts' construction (parents, sizes, scores)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastdecode.config import ConfigError, to_dataclass
from fastdecode.decoding.chain import CARRY
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.kinds import Setup
from fastdecode.drafters.suffix import proposer as suffix_module
from fastdecode.drafters.suffix.index import SuffixIndex
from fastdecode.drafters.suffix.index_file import (
    NotASuffixIndexError,
    SuffixIndexDamagedError,
    SuffixIndexFingerprintError,
    save_index,
)
from fastdecode.drafters.suffix.options import SuffixOptions
from fastdecode.drafters.suffix.proposer import Calibration, SuffixProposer, carried_calibration
from fastdecode.drafters.suffix.sources import (
    global_index,
    global_scope,
    global_sizes,
    remember,
    reset_global_index,
)
from fastdecode.plan.cost import best_node_budget, cost_model
from fastdecode.registry import DECODERS
from fastdecode.runtime.model import EarlyExitModel
from tests.helpers import (
    assert_drafted_and_accepted,
    exact_joint,
    lively_model,
    pair_pvalues,
    random_prompts,
    tiny_model,
    tiny_vocab_model,
)

autoregressive, suffix = DECODERS["autoregressive"], DECODERS["suffix"]


@pytest.fixture(autouse=True)
def empty_global_index():
    reset_global_index()
    yield
    reset_global_index()


def cfg_of(**options) -> DecodeConfig:
    base = {"max_new_tokens": 24, "draft_tokens": 6, "costs": "estimated", "eos_token_id": 2}
    return to_dataclass(DecodeConfig, base | options, "test")


def repeating_prompts() -> list[list[int]]:
    """Ragged prompts whose text repeats (so the row index finds matches from the first round)."""
    return [p * 3 for p in random_prompts(3, seed=4, longest=9)] + [[7, 8, 9]]


def corpus_file(tmp_path, sequences, vocab_size=261, name="corpus.sfx"):
    index = SuffixIndex(16)
    for i, tokens in enumerate(sequences):
        index.add(i, tokens)
    return str(save_index(tmp_path / name, index, fingerprint={"vocab_size": vocab_size, "vocab_hash": "h"}))


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("policy", ["constant", "adaptive"])
def test_greedy_equals_autoregressive_batched_and_single(policy, tree):
    """Chains and token trees (verified by the loop: ``Draft.parents``)."""
    m = lively_model("tiny-llama", 0.1)
    prompts = repeating_prompts()
    cfg = cfg_of(policy=policy, suffix=SuffixOptions(tree=tree))
    expected = autoregressive(m, prompts, cfg).tokens
    out = suffix(m, prompts, cfg)
    assert out.tokens == expected
    assert_drafted_and_accepted(out, policy)
    for row, prompt in enumerate(prompts):  # alone, each row decodes as in the batch
        assert suffix(m, [prompt], cfg).tokens == [expected[row]]


def test_the_global_index_holds_earlier_outputs_and_its_drafts_are_accepted():
    """A prompt decoded again drafts its earlier answer from the global index (accepted nearly whole);
    without a global index the same call drafts far less. Outputs still equal autoregressive's."""
    m = EarlyExitModel(tiny_model("tiny-llama")[0])
    prompts = random_prompts(2, seed=11, longest=12)
    cfg = cfg_of(policy="constant", max_new_tokens=20, eos_token_id=None)
    expected = autoregressive(m, prompts, cfg).tokens
    first = suffix(m, prompts, cfg)
    assert first.tokens == expected and len(global_index(m, SuffixOptions.of(cfg), cfg.eos_ids)) == 2
    again = suffix(m, prompts, cfg)
    assert again.tokens == expected
    alone = cfg.with_options(SuffixOptions(global_size=0))
    without = suffix(m, prompts, alone)
    assert without.tokens == expected
    assert sum(again.accepted) > sum(without.accepted) and again.steps < without.steps


def test_the_global_index_is_bounded_per_model_and_reset():
    m, other = EarlyExitModel(tiny_model("tiny-llama")[0]), lively_model("tiny-llama", 0.1)
    options = SuffixOptions(global_size=3)
    for i in range(5):
        remember(m, options, {2}, [[i, i + 1, i + 2]])
    assert len(global_index(m, options, {2})) == 3  # the oldest two evicted
    assert global_index(m, options, {2}).find([0, 1]) is None and global_index(m, options, {2}).find([4, 5])
    assert len(global_index(other, options, {2})) == 0  # another model never sees these outputs
    reset_global_index()
    assert global_sizes() == {} and len(global_index(m, options, {2})) == 0
    assert global_index(m, SuffixOptions(global_size=0), {2}) is None


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("policy", ["constant", "adaptive"])
def test_a_corpus_is_drafted_from_and_decoding_stays_exact(tmp_path, policy, tree):
    """A corpus that holds the answers: drafts come from it (accepted) and the output is autoregressive's."""
    m = EarlyExitModel(tiny_model("tiny-llama")[0])
    prompts = random_prompts(3, seed=5, longest=10)
    cfg = cfg_of(policy=policy, eos_token_id=None, suffix=SuffixOptions(global_size=0, tree=tree))
    expected = autoregressive(m, prompts, cfg).tokens
    path = corpus_file(tmp_path, [p + e for p, e in zip(prompts, expected, strict=True)])
    with_corpus = cfg.with_options(SuffixOptions(global_size=0, corpus=path, tree=tree))
    out = suffix(m, prompts, with_corpus)
    assert out.tokens == expected
    plain = suffix(m, prompts, cfg)
    assert sum(out.accepted) > sum(plain.accepted)


@pytest.mark.parametrize("tree", [False, True])
def test_sampling_stays_lossless(tree):
    """4000 rows of one prompt whose text repeats, 4 new tokens: every adjacent pair's distribution matches
    the target's exactly computed one; drafts were made and some accepted. Trees: multi-candidate
    speculative sampling over the branches (the prompt continues ``1`` with ``4`` and ``5``)."""
    m = tiny_vocab_model()
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5, 3, 1, 4]
    cfg = DecodeConfig(max_new_tokens=4, temperature=1.0, draft_tokens=3, seed=1, costs="estimated")
    cfg = cfg.with_options(SuffixOptions(global_size=0, min_prob=0.0, tree=tree))
    joint = exact_joint(m, prompt, 4, cfg)
    out = suffix(m, [prompt] * 4000, cfg)
    assert_drafted_and_accepted(out)
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_depth": 1}, r"decoder.suffix.max_depth=1 \(Python: suffix={'max_depth': 1}\)"),
        ({"min_match": 0}, r"decoder.suffix.min_match=0 \(Python: suffix={'min_match': 0}\)"),
        ({"min_match": 64}, "decoder.suffix.min_match=64"),
        ({"min_prob": 1.5}, "decoder.suffix.min_prob=1.5"),
        ({"global_size": -1}, r"decoder.suffix.global_size=-1 \(Python: suffix={'global_size': -1}\)"),
        ({"eos": "never"}, r"suffix eos.*Python: suffix={'eos'"),
        ({"corpus": ""}, r"decoder.suffix.corpus='' \(Python: suffix={'corpus': ''}\)"),
    ],
)
def test_bad_options_are_refused_by_name(options, match):
    """Each names the option as a config sets it and as ``generate`` takes it (``suffix={...}``)."""
    with pytest.raises(ConfigError, match=match):
        to_dataclass(DecodeConfig, {"max_new_tokens": 4, "suffix": options}, "test")


def test_an_exit_layer_is_refused():
    m = EarlyExitModel(tiny_model("tiny-llama")[0])
    with pytest.raises(ConfigError, match="decoder.exit_layer=null"):
        suffix(m, [[1, 2, 3]], cfg_of(exit_layer=1))


def test_damaged_foreign_and_missing_corpus_files_are_refused_before_decoding(tmp_path, monkeypatch):
    m = EarlyExitModel(tiny_model("tiny-llama")[0])
    monkeypatch.setattr(suffix_module.ProposerKind, "proposer", lambda *a, **k: pytest.fail("decoding began"))
    good = corpus_file(tmp_path, [[1, 2, 3, 4]])
    damaged = tmp_path / "damaged.sfx"
    damaged.write_bytes(open(good, "rb").read()[:-5])
    foreign = corpus_file(tmp_path, [[1, 2, 3]], vocab_size=50_000, name="foreign.sfx")
    other = tmp_path / "other.sfx"
    other.write_text('{"hello": 1}\n')
    cases = [
        (str(damaged), SuffixIndexDamagedError, "is damaged"),
        (foreign, SuffixIndexFingerprintError, "another vocabulary"),
        (str(other), NotASuffixIndexError, "not a suffix index file"),
        (str(tmp_path / "missing.sfx"), NotASuffixIndexError, "cannot read it"),
    ]
    for path, error, match in cases:
        with pytest.raises(error, match=match):
            suffix(m, [[1, 2, 3]], cfg_of(suffix=SuffixOptions(corpus=path)))


def test_tree_drafts_are_valid_trees_within_the_budget():
    """decoder.suffix.tree: each row's draft is a tree (parents before children, siblings distinct, padding
    off t), at most the limit, scored by its calibrated path probabilities; chains by default."""
    from fastdecode.decoding.common import Rows
    from fastdecode.decoding.policies import POLICIES
    from fastdecode.decoding.speculative import Round

    m = EarlyExitModel(tiny_model("tiny-llama")[0])
    prompts = [[5, 6, 7, 1, 5, 6, 8, 1, 5, 6, 9, 1, 5, 6], [1, 2, 3], [4, 4, 4, 4]]
    for tree in (True, False):
        cfg = cfg_of(policy="constant", suffix=SuffixOptions(tree=tree, min_prob=0.0))
        proposer = SuffixProposer(Setup(m, prompts, cfg, torch.Generator(), cost_model(m, "estimated")))
        proposer.policy = POLICIES["constant"](cfg.draft_tokens)
        rows = Rows(len(prompts), cfg)
        r = Round(torch.tensor([6, 3, 4]), torch.zeros(3), torch.ones(3, dtype=torch.bool), 5, rows, 0)
        draft = proposer.propose(r)
        lengths = draft.row_lengths()
        assert max(lengths) <= 5 and lengths[1] == 0  # no match in [1, 2, 3]: nothing drafted
        if not tree:
            assert draft.parents is None and draft.tokens[0, :2].tolist() == [8, 1]
            continue
        assert draft.parents is not None and lengths[0] >= 3
        for row, n in enumerate(lengths):
            parents, tokens = draft.parents[row].tolist(), draft.tokens[row].tolist()
            assert all(p == -1 for p in parents[n:])  # padding hangs off t
            assert all(-1 <= p < i for i, p in enumerate(parents[:n]))
            for p in set(parents[:n]):
                children = [tokens[i] for i in range(n) if parents[i] == p]
                assert len(children) == len(set(children))
        # the longest match "1 5 6" went on with 8 and with 9: both are children of the root
        found = proposer.drafted[0]
        assert found.draft.match_length == 3 and found.draft.parents[:2] == [-1, -1]
        assert sorted(found.draft.tokens[:2]) == [8, 9] and found.draft.probs[:2] == [1 / 3, 1 / 3]
        scores = Calibration().scores("row", found.draft)
        for i, parent in enumerate(found.draft.parents):
            assert 0 < scores[i] <= (scores[parent] if parent >= 0 else 1.0)


def test_calibration_learns_from_what_was_accepted():
    """A chain of ratio-1 nodes that is rejected at its second node: that bin's estimate falls; one that is
    accepted whole: it rises. The width weighs the estimates against the verification's cost."""
    from fastdecode.drafters.suffix.index import SuffixDraft

    chain = SuffixDraft([4, 5, 6], [-1, 0, 1], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], match_length=4)
    prior = Calibration().scores("row", chain)
    rejected, accepted = Calibration(), Calibration()
    for _ in range(20):
        rejected.learn("row", chain, [4, 9])
        accepted.learn("row", chain, [4, 5, 6, 1])
    assert rejected.scores("row", chain)[1] < prior[1] < accepted.scores("row", chain)[1]
    costs = SimpleNamespace(verify=lambda tokens: 1.0 + 0.3 * (tokens - 1))  # a wider pass costs more
    assert (
        best_node_budget(costs, [[0.01, 0.001]], plain=1) == 0
    )  # unlikely drafts are not worth a wider pass
    assert best_node_budget(costs, [[0.99, 0.98, 0.97]], plain=1) >= 1


def test_the_calibration_outlives_a_call_decayed_per_model():
    """A call's proposer starts from what earlier calls on the same model learnt, weighted by ``CARRY``;
    another model has its own; emptying the global index (answers) leaves these statistics."""
    m, other = lively_model("tiny-llama", 0.1), EarlyExitModel(tiny_model("tiny-llama")[0])
    prompts, cfg = repeating_prompts(), cfg_of(policy="adaptive")
    expected = autoregressive(m, prompts, cfg).tokens
    assert suffix(m, prompts, cfg).tokens == expected
    learnt = carried_calibration(m, SuffixOptions.of(cfg))
    before = {key: list(tally) for key, tally in learnt.counts.items()}
    assert sum(tried for _, tried in before.values()) > 0
    reset_global_index()
    costs = cost_model(m, "estimated")
    proposer = SuffixProposer(Setup(m, prompts, cfg, torch.Generator(), costs))
    assert proposer.calibration is learnt
    assert {key: tally for key, tally in learnt.counts.items()} == {
        key: [CARRY * accepted, CARRY * tried] for key, (accepted, tried) in before.items()
    }
    fresh = SuffixProposer(Setup(other, prompts, cfg, torch.Generator(), costs))
    assert fresh.calibration is not learnt  # (tiny models are shared across tests: its counts may not be 0)
    assert suffix(m, prompts, cfg).tokens == expected


def test_calibrations_are_kept_apart_per_draft_shape_and_corpus(tmp_path):
    """Acceptance learnt drafting chains over corpus A does not calibrate trees over A, chains over another
    corpus or without one: each starts from the prior alone; chains over A start from what they learnt (was:
    one calibration per model for every shape and corpus)."""
    m = lively_model("tiny-llama", 0.1)
    prompts, base = repeating_prompts(), cfg_of(policy="adaptive", eos_token_id=None)
    expected = autoregressive(m, prompts, base).tokens
    answers = [p + e for p, e in zip(prompts, expected, strict=True)]
    a, b = corpus_file(tmp_path, answers, name="a.sfx"), corpus_file(tmp_path, answers, name="b.sfx")
    costs = cost_model(m, "estimated")

    def options(**given) -> DecodeConfig:
        return base.with_options(SuffixOptions(global_size=0, **given))

    def learnt(cfg: DecodeConfig) -> dict:
        return SuffixProposer(Setup(m, prompts, cfg, torch.Generator(), costs)).calibration.counts

    with global_scope("test_calibrations_are_kept_apart"):  # none of the other tests' calls on this model
        assert suffix(m, prompts, options(corpus=a)).tokens == expected
        assert sum(tried for _, tried in learnt(options(corpus=a)).values()) > 0
        for other in (options(corpus=a, tree=True), options(corpus=b), options()):
            assert learnt(other) == {}, SuffixOptions.of(other)
        assert suffix(m, prompts, options(corpus=a, tree=True)).tokens == expected
        assert learnt(options(corpus=a, tree=True)) and learnt(options(corpus=b)) == {}
