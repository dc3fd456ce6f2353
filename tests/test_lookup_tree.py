"""Prompt lookup as a token tree (fastdecode/drafters/lookup/tree.py) against brute-force searches on random
texts: the occurrences kept, the merged trie (parents first, siblings distinct, every continuation a path,
weights), the EOS cut, the best-first nodes, the batch's node budget; one occurrence drafts the chain; the
``prompt_lookup`` decoder with a tree is lossless; the decoders that cannot draft a tree refuse it."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from fastdecode.config import ConfigError
from fastdecode.decoding.common import Rows
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.policies import POLICIES
from fastdecode.decoding.speculative import Round, Settled
from fastdecode.drafters.lookup.ngram import PromptLookupProposer
from fastdecode.drafters.lookup.options import LookupOptions
from fastdecode.drafters.lookup.tree import (
    LookupTree,
    OccurrenceIndex,
    TreeLookupProposer,
    best_first,
    continuations,
    merge,
    vote,
)
from fastdecode.plan.cost import CostModel, best_node_budget, estimate_costs
from fastdecode.registry import DECODERS
from tests.helpers import (
    assert_drafted_and_accepted,
    exact_joint,
    lively_model,
    pair_pvalues,
    random_prompts,
    tiny_vocab_model,
)

autoregressive = DECODERS["autoregressive"]
CPU_LIKE = CostModel(
    4, 261, (1, 2, 3, 4, 6), (0.2, 0.23, 0.25, 0.27, 0.3), (0.2, 0.21, 0.22, 0.23, 0.25), "measured"
)


def lookup_round(generated: list[list[int]], limit: int) -> Round:
    """A round whose rows have emitted ``generated`` (an n-gram proposer reads only the host lists)."""
    batch = len(generated)
    rows = Rows(batch, DecodeConfig(max_new_tokens=50))
    rows.tokens[:] = [list(t) for t in generated]
    zeros = torch.zeros(batch, dtype=torch.long)
    return Round(zeros, zeros, torch.ones(batch, dtype=torch.bool), limit, rows, start=0)


def brute_starts(tokens, n, keep, match):
    """Every earlier occurrence of the last n tokens with a continuation, as the index must keep them."""
    end = len(tokens)
    if not 1 <= n <= end - 1:
        return []
    starts = [s for s in range(end - n) if tokens[s : s + n] == tokens[end - n :]]
    return starts[::-1][:keep] if match == "recent" else starts[:keep]


def brute_cut(found, stop, eos):
    cuts = [i for i, t in enumerate(found) if t in stop]
    return found[: cuts[0] + (eos == "after")] if cuts else found


def paths(tree: LookupTree) -> list[tuple[int, ...]]:
    out = []
    for node, parent in enumerate(tree.parents):
        out.append((out[parent] if parent >= 0 else ()) + (tree.tokens[node],))
    return out


def random_streams(count, length=70):
    for seed in range(count):
        rng = random.Random(seed)
        tokens, chunks = [], []
        while len(tokens) < length:
            chunk = [rng.randrange(rng.choice([3, 4, 6])) for _ in range(rng.randint(1, 4))]
            tokens += chunk
            chunks.append(list(chunk))
        yield seed, rng, chunks


@pytest.mark.parametrize("eos", ["before", "after"])
@pytest.mark.parametrize("match", ["recent", "earliest"])
def test_the_occurrences_and_the_trie_are_what_a_brute_force_search_finds(match, eos):
    merged = 0
    for seed, rng, chunks in random_streams(40):
        stop = {0} if seed % 2 else set()
        max_n, keep = rng.randint(1, 4), rng.randint(1, 4)
        index = OccurrenceIndex(max_n, keep=keep, match=match, stop=stop, eos=eos)
        tokens = []
        for chunk in chunks:
            index.extend(chunk)
            tokens += chunk
            for n in range(1, max_n + 1):
                assert index.starts_of(n) == brute_starts(tokens, n, keep, match), (seed, tokens, n)
            min_n, limit, shorter = rng.randint(1, max_n), rng.randint(1, 6), rng.random() < 0.5
            found, n = continuations(index, min_n, limit, shorter=shorter)
            longest = next((m for m in range(max_n, min_n - 1, -1) if brute_starts(tokens, m, 1, match)), 0)
            assert n == longest
            expected, seen = [], set()
            for m in range(longest, min_n - 1, -1) if shorter else [longest] if longest else []:
                for s in brute_starts(tokens, m, keep, match):
                    if s + m not in seen:
                        seen.add(s + m)
                        expected.append((brute_cut(tokens[s + m : s + m + limit], stop, eos), vote(m, n)))
            assert [(c.tokens, c.weight) for c in found] == expected
            tree = merge(found, n)
            check_trie(tree, found, stop, eos)
            merged += len(set(tuple(c.tokens) for c in found if c.tokens)) > 1
    assert merged > 100  # many trees had branches


def check_trie(tree, found, stop, eos):
    """Parents first, siblings distinct, the nodes are exactly the continuations' prefixes, with their
    weights; no EOS drafted before, or only as a leaf after."""
    routes = paths(tree)
    assert len(set(routes)) == len(routes)  # siblings carry distinct tokens (equal paths would repeat)
    assert all(-1 <= p < node for node, p in enumerate(tree.parents))
    prefixes = {tuple(c.tokens[:i]) for c in found for i in range(1, len(c.tokens) + 1)}
    assert set(routes) == prefixes
    for node, route in enumerate(routes):
        weight = sum(c.weight for c in found if tuple(c.tokens[: len(route)]) == route)
        assert tree.weights[node] == pytest.approx(weight)
        assert tree.depths[node] == len(route) - 1
        if route[-1] in stop:
            assert eos == "after" and node not in tree.parents
    for node in [*range(len(tree.tokens)), -1]:
        kids = sum(tree.weights[c] for c, p in enumerate(tree.parents) if p == node)
        stopped = [c for c in found if c.stopped and tuple(c.tokens) == (routes[node] if node >= 0 else ())]
        assert tree.totals[node] == pytest.approx(kids + sum(c.weight for c in stopped))


def test_eos_cuts_every_branch_before_or_after_never_past():
    eos = 9
    text = [1, 2, 3, 4, 1, 2, eos, 5, 1, 2, 6, eos, 1, 2]
    for cut, expected in (
        ("before", [(6,), (3,), (3, 4)]),
        ("after", [(6,), (6, eos), (eos,), (3,), (3, 4)]),
    ):
        index = OccurrenceIndex(2, keep=4, stop={eos}, eos=cut)
        index.extend(text)
        found, n = continuations(index, 1, 2)
        assert n == 2 and [c.stopped for c in found] == [cut == "before", cut == "before", False]
        tree = merge(found, n)
        assert sorted(paths(tree)) == sorted(expected)
        # Every vote counts where it goes on, one for an EOS not drafted (before) too.
        assert tree.totals[-1] == 3.0 and tree.totals[tree.tokens.index(6)] == 1.0


def test_best_first_keeps_the_most_likely_paths_parents_first():
    for seed, rng, chunks in random_streams(30, length=90):
        index = OccurrenceIndex(3, keep=4)
        index.extend([t for chunk in chunks for t in chunk])
        found, n = continuations(index, 1, 5, shorter=seed % 2 == 0)
        tree = merge(found, n)
        acceptance = [rng.uniform(0.2, 1.0) for _ in range(5)]
        # Brute force: each node's path probability.
        prob = []
        for node, parent in enumerate(tree.parents):
            up = prob[parent] if parent >= 0 else 1.0
            share = tree.weights[node] / tree.totals[parent]
            prob.append(up * acceptance[tree.depths[node]] * share)
        limit = rng.randint(1, 8)
        nodes, probs = best_first(tree, acceptance, limit)
        assert len(nodes) == min(limit, len(tree.tokens)) and probs == pytest.approx([prob[x] for x in nodes])
        chosen = set(nodes)
        assert all(tree.parents[x] in chosen or tree.parents[x] == -1 for x in nodes)
        assert all(nodes.index(tree.parents[x]) < nodes.index(x) for x in nodes if tree.parents[x] >= 0)
        left = [prob[x] for x in range(len(prob)) if x not in chosen]
        assert not left or min(probs) >= max(left) - 1e-12


def test_the_node_budget_maximises_expected_tokens_per_verification_cost():
    rows = [[0.9, 0.5, 0.4, 0.05], [0.3, 0.1], [0.8, 0.8, 0.7]]
    width = best_node_budget(CPU_LIKE, rows, 4)
    rates = [4 / CPU_LIKE.verify(1)] + [
        (4 + sum(sum(row[:w]) for row in rows)) / CPU_LIKE.verify(w + 1) for w in range(1, 5)
    ]
    assert width == max(range(5), key=lambda w: rates[w]) and width > 0
    assert best_node_budget(CPU_LIKE, [[0.01]], 3) == 0 and best_node_budget(CPU_LIKE, [], 3) == 0


def test_one_occurrence_drafts_what_the_chain_drafts():
    """With occurrences=1 every tree is the chain's draft, cut at the same width, parents a chain."""
    m = lively_model("tiny-llama")
    for seed, rng, chunks in random_streams(25, length=40):
        prompts = [[t + 10 for t in chunk * 3] for chunk in chunks[:3]]
        rows = [p[-rng.randint(1, 3) :] for p in prompts]
        policy = rng.choice(["constant", "adaptive"])
        cfg = DecodeConfig(max_new_tokens=50, eos_token_id=10).with_options(
            LookupOptions(occurrences=1, tree=True)
        )
        chain = PromptLookupProposer(prompts, cfg, CPU_LIKE, m.vocab_size)
        tree = TreeLookupProposer(prompts, cfg, CPU_LIKE, m.vocab_size)
        for proposer in (chain, tree):
            proposer.policy = POLICIES[policy](4, marginal=[0.3] * 4)
        want, got = chain.propose(lookup_round(rows, 4)), tree.propose(lookup_round(rows, 4))
        assert got.lengths == want.lengths and got.tokens.tolist() == want.tokens.tolist(), seed
        for row, length in enumerate(got.lengths):
            assert got.parents[row].tolist() == list(range(-1, length - 1)) + [-1] * (got.k - length)


def test_the_draft_is_a_tree_with_padding_off_the_last_token_and_learns_its_paths():
    m = lively_model("tiny-llama")
    prompts, rows = [[5, 6, 7, 8, 5, 6, 9, 3, 5, 6, 7, 4], [20, 21, 22]], [[5, 6], [23]]
    cfg = DecodeConfig(max_new_tokens=50).with_options(LookupOptions(max_ngram_size=2, tree=True))
    proposer = TreeLookupProposer(prompts, cfg, estimate_costs(m), m.vocab_size)
    proposer.policy = POLICIES["constant"](4)
    draft = proposer.propose(lookup_round(rows, 4))
    # (5, 6) went on with 7 4 | 9 3 | 7 8 (most recent first): 7 holds two votes of three, so it comes
    # first, then 9; 4, 3 and 8 tie (a0 * a1 / 3), taken in the order they were merged.
    assert draft.lengths == [4, 0] and draft.tokens[0].tolist() == [7, 9, 4, 3]
    assert draft.parents.tolist() == [[-1, -1, 0, 1], [-1, -1, -1, -1]] and draft.probs is None
    assert proposer.depths == [2, 0] and proposer.matched == [2, 0]
    proposer.update(None, draft, None, Settled([1, 0], [1, 0], [4, 0]))
    assert proposer.stats.counts == {(2, 0): [1, 1], (2, 1): [0, 1]}
    sampled = TreeLookupProposer(prompts, replace(cfg, temperature=1.0), CPU_LIKE, m.vocab_size)
    sampled.policy = POLICIES["constant"](4)
    probs = sampled.propose(lookup_round(rows, 4)).probs
    assert probs.shape == (2, 4, m.vocab_size) and probs[0, 1, 9] == 1.0


def test_the_prompt_lookup_decoder_with_a_tree_is_lossless(monkeypatch):
    branched = branching_spy(monkeypatch)
    monkeypatch.setattr("fastdecode.decoding.kinds.cost_model", lambda m, source, batch=1: CPU_LIKE)
    m = lively_model("tiny-llama", 0.1)
    prompts = [p + p[:5] + p for p in random_prompts(3, seed=71)]
    for policy in ("constant", "adaptive"):
        lookup = LookupOptions(tree=True, shorter=policy == "adaptive")
        cfg = DecodeConfig(max_new_tokens=24, draft_tokens=4, policy=policy).with_options(lookup)
        out = DECODERS["prompt_lookup"](m, prompts, cfg)
        assert out.tokens == autoregressive(m, prompts, cfg).tokens
        assert sum(out.drafted) > 0
    assert any(branched), "no draft branched: the loop verified chains only"


def branching_spy(monkeypatch) -> list[bool]:
    """Records, per draft of a ``TreeLookupProposer``, whether it branched (some node's parent is not the
    node before it)."""
    seen: list[bool] = []
    propose = TreeLookupProposer.propose

    def spy(self, r):
        draft = propose(self, r)
        chain = torch.arange(draft.k)[None, :] - 1
        seen.append(draft.parents is not None and bool((draft.parents[:, 1:] != chain[:, 1:]).any()))
        return draft

    monkeypatch.setattr(TreeLookupProposer, "propose", spy)
    return seen


def test_sampling_over_lookup_trees_stays_lossless(monkeypatch):
    """4000 rows, 4 new tokens at temperature 1: every adjacent pair's distribution matches the target's
    exactly computed one; the trees branched (``1`` goes on with ``4`` and ``5`` in the prompt)."""
    branched = branching_spy(monkeypatch)
    m = tiny_vocab_model()
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5, 3, 1, 4]
    cfg = DecodeConfig(max_new_tokens=4, temperature=1.0, draft_tokens=3, seed=1, costs="estimated")
    cfg = replace(cfg.with_options(LookupOptions(tree=True)), policy="constant")
    joint = exact_joint(m, prompt, 4, cfg)
    out = DECODERS["prompt_lookup"](m, [prompt] * 4000, cfg)
    assert_drafted_and_accepted(out)
    assert any(branched)
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3


def test_decoders_that_draft_chains_refuse_a_tree():
    m = lively_model("tiny-llama")
    cfg = DecodeConfig(max_new_tokens=4).with_options(LookupOptions(tree=True))
    with pytest.raises(ConfigError, match="decoder 'lookahead' drafts lookup chains only"):
        DECODERS["lookahead"](m, [[1, 2, 3]], cfg)
    with pytest.raises(ConfigError, match="'self_speculative' with decoder.chain=true drafts lookup chains"):
        DECODERS["self_speculative"](m, [[1, 2, 3]], replace(cfg, chain=True, exit_layer=1))
    with pytest.raises(ConfigError, match="occurrences=0: need >= 1"):
        LookupOptions(occurrences=0)
