"""Token trees (``fastdecode/decoding/tree.py``) and their verification in the speculative loop: the pure
functions on hand-made trees, the multi-candidate sampling rule's output distribution, the block mask and the
cache compaction, then whole decodes with a test proposer whose trees mix the reference continuation with
wrong siblings and subtrees (greedy equals autoregressive, accepted counts as the reference implies, the
cache equals plain decoding's, sampling matches the target's distribution)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from fastdecode.decoding import tree
from fastdecode.decoding.common import prefill
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.kinds import ProposerKind, Setup
from fastdecode.decoding.proposers import Proposer, one_hot
from fastdecode.decoding.speculative import Draft, Round, rule, verify
from fastdecode.registry import DECODERS
from fastdecode.runtime.cache import KVCache, StaticKVCache, attention_mask, layer_mask
from fastdecode.runtime.model import EarlyExitModel
from tests.conftest import ENGINES, REFERENCE, TINY_MODELS
from tests.helpers import (
    chi2_pvalue,
    exact_joint,
    lively_model,
    padded_verification,
    pair_pvalues,
    random_prompts,
    tiny_model,
    tiny_vocab_model,
)

autoregressive = DECODERS["autoregressive"]

# t; node 0 and node 1 under t; nodes 2, 3 under node 0; node 4 under node 2; node 5 under t
PARENTS = torch.tensor([[-1, -1, 0, 0, 2, -1]])
TOKENS = torch.tensor([[7, 3, 5, 6, 2, 9]])


def test_depths_ancestors_and_positions_of_a_hand_made_tree():
    assert tree.depths(PARENTS).tolist() == [[1, 1, 2, 2, 3, 1]]
    mask = tree.ancestor_mask(PARENTS, 8)[0].int().tolist()
    # rows: t, d0..d5, one padding position; columns the same
    assert mask == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 1, 0, 0],
        [1, 0, 0, 0, 0, 0, 1, 0],
        [1, 0, 0, 0, 0, 0, 0, 1],
    ]
    assert tree.position_depths(PARENTS, 8).tolist() == [[0, 1, 1, 2, 2, 3, 1, 1]]
    chain = tree.chain_parents(1, 4)
    assert tree.ancestor_mask(chain).equal(torch.ones(5, 5, dtype=torch.bool).tril()[None])
    with pytest.raises(ValueError, match="width 5"):
        tree.ancestor_mask(PARENTS, 5)


def test_greedy_walk_follows_the_longest_agreeing_branch():
    tokens, parents = TOKENS.expand(4, -1), PARENTS.expand(4, -1)
    valid = torch.ones(4, 6, dtype=torch.bool)
    valid[3, 4:] = False  # row 3 drafted 4 nodes: node 4 is padding
    target = torch.zeros(4, 7, dtype=torch.long)
    target[0, [0, 1, 3]] = torch.tensor([7, 5, 2])  # t -> 7 (node 0) -> 5 (node 2) -> 2 (node 4)
    target[1, [0, 1]] = torch.tensor([7, 6])  # t -> 7 (node 0) -> 6 (node 3)
    target[2, 0] = 9  # t -> 9 (node 5, after two wrong siblings)
    target[3, [0, 1, 3]] = torch.tensor([7, 5, 2])  # as row 0, but node 4 was not drafted
    node = tree.greedy_walk(tokens, parents, valid, target)
    assert node.tolist() == [4, 3, 5, 2]
    assert tree.node_depth(parents, node).tolist() == [3, 2, 1, 2]
    assert tree.node_depth(parents, torch.tensor([-1, -1, -1, -1])).tolist() == [0] * 4
    order = tree.path_order(parents, node)
    assert order.tolist() == [[0, 2, 4, 1, 3, 5], [0, 3, 1, 2, 4, 5], [5, 0, 1, 2, 3, 4], [0, 2, 1, 3, 4, 5]]


def test_multi_candidate_sampling_emits_the_target_distribution():
    """A tiny vocabulary; t's children are tokens 2, 0 and 3 in that order, node 0 (token 2) has children 1
    and 2. The first emitted token (an accepted child, or the residual draw) must follow p at t, and the one
    after an accepted token 2 must follow p at node 0. Accepting each child with its original p (no mass
    removed after a rejection) would give child 0 too little: caught."""
    n, vocab = 60000, 5
    gen = torch.Generator().manual_seed(0)
    p_t = torch.tensor([0.3, 0.05, 0.25, 0.1, 0.3])
    p_0 = torch.tensor([0.1, 0.5, 0.2, 0.2, 0.0])
    p = torch.stack([p_t, p_0, torch.full((5,), 0.2), torch.full((5,), 0.2), p_0.flip(0), p_0]).expand(
        n, -1, -1
    )
    tokens = torch.tensor([2, 0, 3, 1, 2]).expand(n, -1)
    parents = torch.tensor([-1, -1, -1, 0, 0]).expand(n, -1)
    valid = torch.ones(n, 5, dtype=torch.bool)
    node, residual = tree.sample_walk(tokens, parents, valid, p, torch.rand(n, 5, generator=gen))
    nxt = torch.multinomial(residual, 1, generator=gen)[:, 0]
    level_one = torch.where(node >= 3, 0, node)  # the accepted child of t (nodes 3, 4 lie under node 0)
    first = torch.where(level_one < 0, nxt, tokens[0].gather(0, level_one.clamp_min(0)))
    assert chi2_pvalue(torch.bincount(first, minlength=vocab).float(), p_t * n) > 1e-3
    under = node.eq(0) | node.ge(3)  # node 0 accepted: the next token is its child's or the residual draw
    after = torch.where(node == 0, nxt, torch.where(node == 3, 1, 2))[under]
    expected = p_0 * int(under.sum())
    assert chi2_pvalue(torch.bincount(after, minlength=vocab).float(), expected) > 1e-3
    assert not (nxt[node == 0] == 4).any()  # probability 0 at node 0: never drawn
    # a token the target gives no probability is never accepted
    zero = p.clone()
    zero[:, 0, 2] = 0.0
    node, _ = tree.sample_walk(tokens[:100], parents[:100], valid[:100], zero[:100], torch.zeros(100, 5))
    assert not (node == 0).any() and (node == 1).all()


@pytest.mark.parametrize("static", [False, True])
def test_reorder_moves_every_layer_and_the_slot_state(static):
    kind = StaticKVCache if static else KVCache
    cache = kind(2, 2, 1, 3, 8, torch.float32, "cpu")
    for layer in range(2):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape))
    cache.key_valid[:, :6] = True
    cache.key_valid[1, 4] = False
    cache.key_pos.copy_(torch.arange(cache.capacity).expand(2, -1) * 10)
    before = [t.clone() for t in (*cache.k, *cache.v, cache.key_valid, cache.key_pos)]
    addresses = [t.data_ptr() for t in (*cache.k, *cache.v)]
    order = torch.tensor([[2, 0, 1, 3], [3, 2, 1, 0]])
    cache.reorder(2, order)
    for old, new in zip(before, (*cache.k, *cache.v, cache.key_valid, cache.key_pos), strict=True):
        expected = old.clone()
        for row in range(2):
            if old.dim() == 4:  # keys/values [B, H, S, D]
                expected[row, :, 2:6] = old[row, :, 2 + order[row]]
            else:  # key_valid / key_pos [B, S]
                expected[row, 2:6] = old[row, 2 + order[row]]
        assert new.equal(expected)
    assert [t.data_ptr() for t in (*cache.k, *cache.v)] == addresses


def test_block_mask_composes_with_validity_and_disables_the_maskless_shortcut():
    cache = KVCache(1, 1, 1, 2, 8, torch.float32, "cpu")
    cache.key_valid[:, :3] = True
    hidden, pos = torch.zeros(1, 3, 4), torch.tensor([[0, 1, 1]])
    # a causal block from slot 0 on a valid dynamic cache needs no mask, a tree's block does
    assert layer_mask(hidden, cache, 0, None, pos, sdpa=True, engine_lean=True) is None
    cache.block = (0, tree.ancestor_mask(torch.tensor([[-1, -1]])))  # t, two children of t
    mask = layer_mask(hidden, cache, 0, None, pos, sdpa=True, engine_lean=True)
    assert (mask[0, 0] == 0).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    cache.key_valid[0, 1] = False  # composed with validity
    mask = layer_mask(hidden, cache, 0, None, pos, sdpa=False, engine_lean=None)
    assert (mask[0, 0] == 0).int().tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 1]]
    with pytest.raises(ValueError, match="block mask"):
        attention_mask(cache.key_valid, 1, 3, torch.float32, block=cache.block)


def test_rule_linearises_the_accepted_branch_everywhere():
    """t; nodes 0 and 1 under t, node 2 under node 1; the target agrees with node 1 then node 2: two drafts
    accepted, the branch first in the draft handed to ``settle``, in its features and verifier argmaxes, and
    in the slots of every cache."""
    vocab, start = 8, 3
    logits = torch.zeros(1, 4, vocab)
    logits[0, torch.arange(4), torch.tensor([5, 1, 6, 2])] = 1.0  # argmax at t, node 0, node 1, node 2
    features = torch.arange(4.0).reshape(1, 4, 1).expand(-1, -1, 2)
    draft = Draft(torch.tensor([[4, 5, 6]]), parents=torch.tensor([[-1, -1, 1]]), features=features)
    caches = [KVCache(1, 1, 1, 2, 8, torch.float32, "cpu") for _ in range(2)]
    for cache in caches:
        cache.key_pos.copy_(torch.arange(8)[None])
    verdict, linear = rule(
        logits, draft, DecodeConfig(max_new_tokens=4), generator=None, caches=caches, start=start
    )
    assert (verdict.accepted.tolist(), verdict.oracle.tolist(), verdict.next_token.tolist()) == (
        [2],
        [2],
        [2],
    )
    assert linear.tokens.tolist() == [[5, 6, 4]] and linear.parents is None and linear.row_lengths() == [3]
    assert linear.features[0, :, 0].tolist() == [0.0, 2.0, 3.0, 1.0]
    assert verdict.target.tolist() == [[5, 6, 2, 1]]
    for cache in caches:  # the branch after t; slots past the longest branch stay as they were (rolled back)
        assert cache.key_pos[0].tolist() == [0, 1, 2, 3, 5, 6, 6, 7]
    sampling = DecodeConfig(max_new_tokens=4, temperature=1.0)
    draft.probs = torch.full((1, 3, vocab), 1 / vocab)  # drawn, not deterministic: the rule would be wrong
    with pytest.raises(ValueError, match="deterministic"):
        rule(logits, draft, sampling, generator=torch.Generator(), caches=[], start=start)


# --------------------------------------------------------------------------------------------------------
# A test proposer: trees around the reference continuation
SHAPES = ("depth1", "branch", "kary", "random")


def tree_shape(shape: str, n: int, cap: int, rng: random.Random) -> list[int]:
    """Parents of ``n`` nodes of ``shape``, no node deeper than ``cap`` (fewer nodes where that runs out)."""
    parents: list[int] = []
    depth: list[int] = []
    for j in range(n):
        if shape == "depth1":
            parent = -1
        elif shape == "branch":
            parent = j - 1
        elif shape == "kary":
            parent = j // 2 - 1
        else:
            parent = rng.choice([-1] + [i for i in range(j) if depth[i] < cap])
        d = 1 if parent < 0 else depth[parent] + 1
        if d > cap:
            break
        parents.append(parent)
        depth.append(d)
    return parents


def grow_tree(
    shape: str, limit: int, right: list[int], rng: random.Random, vocab: int
) -> tuple[list[int], list[int], int]:
    """``(tokens, parents, accepted)``: a tree of up to ``limit`` nodes no deeper than ``right`` (the reference
    continuation after t) whose branch along ``right`` stops at a random depth; every other child of a node
    on that branch is a wrong token; ``accepted``: the depth that branch reaches."""
    cap = len(right)
    parents = tree_shape(shape, rng.randint(0, limit) if rng.random() < 0.8 else limit, cap, rng)
    stop = rng.randint(0, cap)
    tokens = [0] * len(parents)
    on_branch = {-1: True}
    depth = {-1: 0}
    for parent in [-1, *range(len(parents))]:
        kids = [j for j, p in enumerate(parents) if p == parent]
        if not kids:
            continue
        good = right[depth[parent]] if on_branch.get(parent) and depth[parent] < cap else None
        chosen = rng.choice(kids) if good is not None and depth[parent] < stop else None
        wrong = [v for v in range(vocab) if v != good]
        for kid, token in zip(kids, rng.sample(wrong, len(kids)), strict=False):
            tokens[kid] = good if kid == chosen else token
            on_branch[kid] = kid == chosen
            depth[kid] = depth[parent] + 1
    accepted = max(depth[j] for j in on_branch if on_branch[j])
    return tokens, parents, accepted


class TreeProposer(Proposer):
    """Deterministic trees: around the reference continuation ``reference`` (per row the tokens greedy decoding
    emits) when given, else of random tokens. Books each round's expected and actual accepted counts."""

    name = "tree"

    def __init__(self, s: Setup, shape: str, reference: list[list[int]] | None, seed: int = 0) -> None:
        self.costs, self.cfg, self.vocab_size = s.costs, s.cfg, s.m.vocab_size
        self.shape, self.reference, self.rng = shape, reference, random.Random(seed)
        self.expected: list[int] = []
        self.accepted: list[int] = []
        self.drafted = 0

    def start(self, m, prompts, capacity):
        self.state = super().start(m, prompts, capacity)
        return self.state

    def propose(self, r: Round) -> Draft:
        trees, self.round = [], []
        for row, emitted in enumerate(r.rows.tokens):
            live = not r.rows.finished[row] and r.limit > 0
            right = self.reference[row][len(emitted) :] if self.reference else [0] * r.limit
            shape = self.shape if self.shape != "mixed" else self.rng.choice(SHAPES)
            tokens, parents, accepted = grow_tree(shape, r.limit, right, self.rng, self.vocab_size)
            trees.append((tokens, parents) if live else ([], []))
            self.round.append(accepted if live else None)
        width = max(len(t) for t, _ in trees)
        tokens = torch.tensor([t + [0] * (width - len(t)) for t, _ in trees], dtype=torch.long)
        parents = torch.tensor([p + [-1] * (width - len(p)) for _, p in trees], dtype=torch.long)
        probs = None if self.cfg.greedy else one_hot(tokens, self.vocab_size)
        return Draft(tokens, probs, [len(t) for t, _ in trees], parents=parents.reshape(len(trees), width))

    def update(self, r, draft, verdict, done) -> None:
        for row, expected in enumerate(self.round):
            if expected is not None and done.accepted[row] is not None:
                self.expected.append(expected)
                self.accepted.append(done.accepted[row])
                self.drafted += done.lengths[row]


def tree_decode(m, prompts, cfg, shape, reference=None, seed=0) -> tuple[list[list[int]], TreeProposer]:
    made: list[TreeProposer] = []

    def build(s: Setup) -> TreeProposer:
        made.append(TreeProposer(s, shape, reference, seed))
        return made[-1]

    out = ProposerKind("tree", build).generate(m, prompts, cfg)
    return out.tokens, made[0]


def assert_cache_is_plain_decodings(m, prompts, tokens, cache) -> None:
    """Every row's valid slots hold, in order, the keys/values and positions that prefilling its prompt and
    its emitted tokens (all but the last, which no cache holds yet) leaves."""
    for row, (prompt, emitted) in enumerate(zip(prompts, tokens, strict=True)):
        plain = prefill(m, [prompt + emitted[:-1]], 8).cache
        slots = cache.key_valid[row, : cache.lengths[0]].nonzero()[:, 0]  # slots past the pointer: stale
        assert len(slots) == len(prompt) + len(emitted) - 1, row
        assert cache.key_pos[row, slots].tolist() == list(range(len(slots))), row
        for layer in range(m.num_layers):
            for mine, theirs in ((cache.k, plain.k), (cache.v, plain.v)):
                torch.testing.assert_close(mine[layer][row][:, slots], theirs[layer][0][:, : len(slots)])


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tree_drafting_greedy_equals_autoregressive(name):
    """Every tree shape, a ragged batch of 6 and two rows alone: the same tokens as autoregressive decoding,
    the accepted count of every round is the depth of the reference branch in the tree, and the cache after
    the last round is the one plain decoding leaves."""
    m = lively_model(name)
    prompts = random_prompts(6, seed=TINY_MODELS.index(name) + 70)
    cfg = DecodeConfig(max_new_tokens=14, draft_tokens=6, eos_token_id=m.config.eos_token_id, **REFERENCE)
    ref = autoregressive(m, prompts, cfg).tokens
    for shape in (*SHAPES, "mixed"):
        tokens, proposer = tree_decode(m, prompts, cfg, shape, ref, seed=len(shape))
        assert tokens == ref, shape
        assert proposer.accepted == proposer.expected, shape
        assert sum(proposer.accepted) > 0, shape
        assert_cache_is_plain_decodings(m, prompts, tokens, proposer.state.cache)
        for i in (1, 4):
            alone, _ = tree_decode(m, [prompts[i]], cfg, shape, [ref[i]], seed=i)
            assert alone == [ref[i]], (shape, i)


@pytest.mark.parametrize("engine", ["hf", "fast", "static"])
def test_tree_drafting_on_the_execution_paths(engine, monkeypatch):
    """The static-shape cache (and the reference), with verifications padded past the tree
    (``CostModel.run_length``): the padding positions are attended by no node."""
    seen = padded_verification(monkeypatch)
    m = lively_model("tiny-mistral")  # a sliding window: positions by depth reach the window's arithmetic
    prompts = random_prompts(5, seed=71)
    cfg = DecodeConfig(max_new_tokens=14, draft_tokens=5, costs="estimated", **ENGINES[engine])
    ref = autoregressive(m, prompts, replace(cfg, **REFERENCE)).tokens
    tokens, proposer = tree_decode(m, prompts, cfg, "mixed", ref)
    assert tokens == ref
    assert proposer.accepted == proposer.expected and sum(proposer.accepted) > 0
    assert any(run > t for t, run in seen)
    assert_cache_is_plain_decodings(m, prompts, tokens, proposer.state.cache)


def test_tree_sampling_matches_the_target_distribution():
    """4000 rows of one prompt, random trees of random tokens over 8 tokens: every adjacent pair of the 4 new
    tokens follows the target's exactly computed joint distribution."""
    m = tiny_vocab_model()
    prompt, samples = [3, 1, 4, 1, 5], 4000
    cfg = DecodeConfig(max_new_tokens=4, temperature=1.0, draft_tokens=4, seed=3, costs="estimated")
    joint = exact_joint(m, prompt, 4, cfg)
    tokens, proposer = tree_decode(m, [prompt] * samples, cfg, "mixed")
    accepted = sum(proposer.accepted)
    assert accepted > 100 and proposer.drafted - accepted > 100  # both the accept and the residual paths
    assert min(pair_pvalues(tokens, joint)) > 1e-3


def test_a_tree_over_target_layers_already_run_is_refused():
    m = EarlyExitModel(tiny_model("tiny-llama")[0])
    state = prefill(m, [[1, 2, 3]], 16)
    r = Round(torch.tensor([4]), torch.tensor([3]), torch.tensor([True]), 2, None, 3)
    hidden = torch.zeros(1, 3, m.config.hidden_size)
    draft = Draft(torch.tensor([[5, 6]]), hidden=hidden, depth=1, parents=torch.tensor([[-1, -1]]))
    with pytest.raises(ValueError, match="not supported"):
        verify(m, state.cache, r, draft)
    assert state.cache.block is None
