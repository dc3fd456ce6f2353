"""EAGLE-2's dynamic draft trees drafted by the EAGLE-3 head (``decoder.eagle3.tree``,
``fastdecode/drafters/eagle3/tree.py``): every node is among the head's top-k after its own path (the tree
mask over the head's keys and positions by depth), the head's cache is left as the chain path leaves it,
greedy decoding equals autoregressive decoding on every family and engine, sampling stays lossless."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fastdecode.api import FastDecoder
from fastdecode.config import ConfigError
from fastdecode.decoding.autoregressive import generate as autoregressive
from fastdecode.decoding.common import Rows
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.policies import POLICIES as POLICY_CLASSES
from fastdecode.decoding.speculative import Round
from fastdecode.drafters.eagle3 import kind as eagle3_kind
from fastdecode.drafters.eagle3.kind import load_head
from fastdecode.drafters.eagle3.options import Eagle3Options
from fastdecode.drafters.eagle3.proposer import Eagle3Proposer
from fastdecode.drafters.eagle3.tree import grow, node_budget
from fastdecode.registry import DECODERS
from tests.conftest import ENGINES, REFERENCE, TINY_MODELS
from tests.eagle3_heads import head_dir, random_tiny_vocab_head, training_sequences
from tests.helpers import exact_joint, pair_pvalues, tiny_model, tiny_vocab_model
from tests.test_eagle3_decoding import mixed_prompts, target

TREE = Eagle3Options(tree=True, top_k=3)


def recording(monkeypatch) -> list[torch.Tensor]:
    """The ``parents`` of every tree the proposer drafts from now on."""
    seen, propose = [], Eagle3Proposer.propose_tree

    def record(self, *args):
        draft = propose(self, *args)
        if draft.parents is not None:
            seen.append(draft.parents.clone())
        return draft

    monkeypatch.setattr(Eagle3Proposer, "propose_tree", record)
    return seen


def branches(parents: torch.Tensor) -> bool:
    """Whether some node of some row has two children (t included as node -1)."""
    for row in parents.tolist():
        if len(row) != len(set(row)):
            return True
    return False


def one_round(tree: bool, top_k: int = 3, *, policy: str = "constant", costs=None):
    """Prefill two ragged prompts, draft one round of 4: (the proposer, the round, the draft, the head's
    keys, values and validity of the committed slots before the draft)."""
    m = target("tiny-llama")
    head = load_head(head_dir(m), m)
    prompts = [training_sequences(m)[0, :12].tolist(), [7, 8, 9, 10, 11]]
    cfg = DecodeConfig(max_new_tokens=8).with_options(Eagle3Options(tree=tree, top_k=top_k))
    proposer = Eagle3Proposer(m, head, cfg, torch.Generator(), costs=costs)
    proposer.policy = POLICY_CLASSES[policy](4)
    with torch.inference_mode():
        state = proposer.start(m, prompts, 32)
        r = Round(torch.tensor([50, 60]), state.positions, torch.tensor([True, True]), 4, Rows(2, cfg), 12)
        proposer.pending = proposer.last_row(r)
        cache = proposer.head_rows.cache
        before = (len(proposer.head_rows), cache.k[0].clone(), cache.v[0].clone(), cache.key_valid.clone())
        draft = proposer.propose(r)
    return proposer, r, draft, before


def test_every_node_scores_the_heads_probability_along_its_own_path():
    """Every node the tree offers carries the head's log path probability computed as a chain on the head
    alone along t and the node's ancestors (a sibling or cousin visible to a row, a wrong position or a wrong
    parent's hidden state changes it); the tree branches; the head's cache is back where it stood, as the
    chain path leaves it."""
    proposer, r, draft, before = one_round(tree=True)
    chain = one_round(tree=False)
    assert draft.parents is not None and branches(draft.parents) and draft.tokens.shape[1] == 4
    rows, vocab = proposer.head_rows, proposer.vocab
    for state in (before, chain[3]):  # the committed rows, untouched, and the chain path's head cache
        assert len(rows) == state[0] == len(chain[0].head_rows)
        cache = rows.cache
        assert torch.equal(cache.k[0][:, :, : state[0]], state[1][:, :, : state[0]])
        assert torch.equal(cache.v[0][:, :, : state[0]], state[2][:, :, : state[0]])
        assert torch.equal(cache.key_valid[:, : state[0]], state[3][:, : state[0]])
    base = len(rows) - 1  # t's row, rewritten as it was
    with torch.inference_mode():
        rows.crop(base)
        pool, passes = grow(rows, proposer.last_row(r), r.positions, vocab, levels=4, top_k=3, keep=30)
        rows.crop(base)
    tokens, scores, parents = (torch.cat(x, 1) for x in (pool.tokens, pool.scores, pool.parents))
    assert passes == 3 and pool.size == 3 + 3 * 9
    for row in range(2):
        for node in range(pool.size):
            path, at = [], node
            while at >= 0:
                path.insert(0, at)
                at = int(parents[row, at])
            chain_tokens = vocab[tokens[:, path]]  # the other row follows the same indices
            with torch.inference_mode():
                logits, hidden = proposer.last_row(r)
                total = torch.log_softmax(logits[row, -1].float(), -1)[tokens[row, path[0]]]
                for depth in range(1, len(path)):
                    at = (r.positions + depth)[:, None]
                    logits, hidden = rows.add(chain_tokens[:, depth - 1 : depth], hidden, at, on(2))
                    total += torch.log_softmax(logits[row, -1].float(), -1)[tokens[row, path[depth]]]
            rows.crop(base)
            assert torch.allclose(total, scores[row, node], atol=1e-4), (row, node)


def on(batch: int) -> torch.Tensor:
    return torch.ones(batch, 1, dtype=torch.bool)


@pytest.mark.parametrize("engine", ["hf", "static"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_tree_greedy_equals_autoregressive(name, engine, monkeypatch):
    """12 ragged prompts batched, 2 alone, both policies; the trees branch; on the text the head learnt its
    trees are right round after round (the rows ``update`` recomputes read the accepted branch's features)."""
    seen = recording(monkeypatch)
    m = target(name)
    path, prompts = head_dir(m), mixed_prompts(m)
    eos = m.config.eos_token_id
    base = DecodeConfig(
        max_new_tokens=16, draft_tokens=4, costs="estimated", drafter=path, eos_token_id=eos
    ).with_options(TREE)
    ref = autoregressive(m, prompts, replace(base, **REFERENCE)).tokens
    base = replace(base, **ENGINES[engine])
    for policy in ("constant", "adaptive"):
        cfg = replace(base, policy=policy)
        out = DECODERS["eagle3"](m, prompts, cfg)
        assert out.tokens == ref, policy
        assert sum(out.drafted) > sum(out.accepted) > 0, policy
        for i in (1, 9):
            assert DECODERS["eagle3"](m, [prompts[i]], cfg).tokens == [ref[i]], (policy, i)
    assert any(branches(parents) for parents in seen)
    learnt = DECODERS["eagle3"](m, prompts[:8], replace(base, policy="constant"))
    assert learnt.tokens == ref[:8] and learnt.acceptance_rate > 0.9, learnt.acceptance_rate


def test_a_level_no_kept_node_can_reach_is_not_expanded(tmp_path, monkeypatch):
    """A random head's flat drafts: the best nodes are shallow, so ``grow`` stops where no deeper node could be
    among the round's nodes. Every tree verified is the full tree's, round by round, the text is
    autoregressive decoding's, and the head runs fewer passes (counted)."""
    import fastdecode.drafters.eagle3.proposer as proposer_module
    from fastdecode.drafters.eagle3.proposer import HeadRows
    from tests.eagle3_heads import random_head_dir

    m = target("tiny-llama")
    prompts = mixed_prompts(m)[:4]
    cfg = DecodeConfig(
        max_new_tokens=12, draft_tokens=6, costs="estimated", drafter=random_head_dir(tmp_path)
    ).with_options(Eagle3Options(tree=True, top_k=2))
    ref = autoregressive(m, prompts, replace(cfg, **REFERENCE)).tokens
    real_grow, real_add = proposer_module.grow, HeadRows.add

    def run(full: bool, policy: str) -> tuple[list, list[tuple], int]:
        passes = [0]  # the head's forwards: prefill, t's rows, tree levels, the kept rows

        def add(self, *args, **kwargs):
            passes[0] += 1
            return real_add(self, *args, **kwargs)

        def grow_all(*args, **kwargs):  # every level expanded: the tree as it was grown before
            return real_grow(*args, **kwargs, keep=10**6)

        monkeypatch.setattr(HeadRows, "add", add)
        monkeypatch.setattr(proposer_module, "grow", grow_all if full else real_grow)
        drafted = []
        real_propose = Eagle3Proposer.propose_tree

        def propose(self, *args):
            draft = real_propose(self, *args)
            drafted.append((draft.tokens.clone(), None if draft.parents is None else draft.parents.clone()))
            return draft

        monkeypatch.setattr(Eagle3Proposer, "propose_tree", propose)
        out = DECODERS["eagle3"](m, prompts, replace(cfg, policy=policy))
        monkeypatch.undo()
        return out.tokens, drafted, passes[0]

    for policy in ("constant", "adaptive"):
        tokens, trees, passes = run(False, policy)
        full_tokens, full_trees, full_passes = run(True, policy)
        assert tokens == full_tokens == ref, policy
        assert len(trees) == len(full_trees) and any(p is not None and branches(p) for _, p in trees)
        for (drafted, parents), (want, want_parents) in zip(trees, full_trees, strict=True):
            assert torch.equal(drafted, want) and (parents is None) == (want_parents is None), policy
            assert parents is None or torch.equal(parents, want_parents), policy
        assert passes < full_passes, (policy, passes, full_passes)


def test_tree_sampling_matches_the_target_distribution(tmp_path, monkeypatch):
    """4000 rows of one prompt, 4 new tokens, trees of 4 nodes (top-2 per node) from a random head over 6
    of the 8 tokens: accepted and rejected branches, every adjacent pair's distribution the target's."""
    seen = recording(monkeypatch)
    m = tiny_vocab_model()
    head = random_tiny_vocab_head(m, tmp_path)
    prompt, samples = [3, 1, 4, 1, 5], 4000
    cfg = DecodeConfig(
        max_new_tokens=4,
        temperature=1.0,
        draft_tokens=4,
        seed=3,
        costs="estimated",
        policy="constant",
        drafter=head,
    ).with_options(Eagle3Options(tree=True, top_k=2))
    joint = exact_joint(m, prompt, 4, cfg)
    out = DECODERS["eagle3"](m, [prompt] * samples, cfg)
    accepted, drafted = sum(out.accepted), sum(out.drafted)
    assert accepted > 100 and drafted - accepted > 100
    assert any(branches(parents) for parents in seen)
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3


def test_tree_options_are_checked():
    with pytest.raises(ConfigError, match="top_k"):
        Eagle3Options(tree=True, top_k=0)
    m = target("tiny-llama")
    cfg = DecodeConfig(max_new_tokens=4, drafter=head_dir(m), chain=True).with_options(TREE)
    with pytest.raises(ConfigError, match="decoder.chain=false"):
        eagle3_kind.check(m, [[1, 2, 3]], cfg)


class Linear:
    """A cost model whose verification of T positions costs ``1 + slope * (T - 1)`` steps."""

    def __init__(self, slope: float) -> None:
        self.slope = slope

    def verify(self, tokens: int) -> float:
        return 1 + self.slope * (tokens - 1)


def test_the_node_budget_is_where_expected_tokens_per_cost_peak():
    """Path probabilities 0.9, 0.8, 0.1, 0.05 at 0.5 steps per extra position: 1.9 / 1.5 < 2.7 / 2 > 2.8 / 2.5
    (a finished row's sure nodes do not count); a verification as dear as the steps it could save
    drafts nothing, and the proposer then hands over an empty draft."""
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.05], [1.0, 1.0, 1.0, 1.0]]).log()
    live = torch.tensor([True, False])
    assert node_budget(scores, live, Linear(0.5), 4) == 2
    assert node_budget(scores, live, Linear(0.5), 1) == 1
    assert node_budget(scores, live, Linear(1.0), 4) == 0
    assert node_budget(scores, live, Linear(0.1), 4) == 2  # 2.7 / 1.2 > 2.8 / 1.3
    assert node_budget(scores, torch.tensor([True, True]), Linear(0.1), 4) == 4  # a live row's sure nodes
    _, _, draft, _ = one_round(tree=True, policy="adaptive", costs=Linear(1.0))
    assert draft.k == 0 and draft.parents is None
    _, _, draft, _ = one_round(tree=True, policy="adaptive", costs=Linear(0.0))
    assert draft.k == 4 and draft.parents is not None


def test_generate_takes_the_tree_option(monkeypatch):
    """``generate(method="eagle3", eagle3={"tree": True, "top_k": 2})``: trees drafted, the text unchanged."""
    seen = recording(monkeypatch)
    m = target("tiny-llama")
    fd = FastDecoder(m.hf, tiny_model("tiny-llama")[1], m=m)
    prompts = mixed_prompts(m)[6:10]
    ref = autoregressive(m, prompts, DecodeConfig(max_new_tokens=12, eos_token_id=m.config.eos_token_id))
    options = dict(method="eagle3", drafter=head_dir(m), costs="estimated")
    result = fd.generate(prompts, max_new_tokens=12, eagle3={"tree": True, "top_k": 2}, **options)
    assert result.ids == ref.tokens and seen and any(branches(parents) for parents in seen)
