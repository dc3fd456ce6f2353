"""The suffix index against a brute-force search over the raw sequences, on random texts of small vocabularies
(so substrings repeat), and its file: round trip, damaged and foreign files refused by name."""

from __future__ import annotations

import heapq
import itertools
import random
from types import SimpleNamespace

import pytest

from fastdecode.drafters.suffix.index import SuffixIndex
from fastdecode.drafters.suffix.index_file import (
    NotASuffixIndexError,
    SuffixIndexDamagedError,
    SuffixIndexFingerprintError,
    SuffixIndexVersionError,
    load_index,
    save_index,
)
from fastdecode.drafters.suffix.sources import corpus_index
from fastdecode.errors import UserError

CASES = [(seed, vocab, depth) for seed in range(4) for vocab, depth in ((3, 4), (4, 7), (6, 64), (2, 3))]


def texts(seed: int, vocab: int, count: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def occurrences(seqs: list[list[int]], pattern: list[int]) -> int:
    """How many times ``pattern`` occurs as a substring of ``seqs``, by scanning."""
    n = len(pattern)
    return sum(seq[i : i + n] == pattern for seq in seqs for i in range(len(seq) - n + 1))


def brute_continuations(seqs, pattern, depth, vocab):
    if len(pattern) >= depth:
        return []
    found = [(t, occurrences(seqs, [*pattern, t])) for t in range(vocab)]
    return sorted(((t, c) for t, c in found if c), key=lambda tc: (-tc[1], tc[0]))


def brute_match(seqs, context, depth, vocab):
    """The longest suffix of ``context`` (< depth tokens) that occurs with a continuation, trying them all."""
    for n in range(min(len(context), depth - 1), 0, -1):
        if brute_continuations(seqs, context[len(context) - n :], depth, vocab):
            return n
    return 0


def dump(index: SuffixIndex) -> dict[tuple[int, ...], int]:
    """Every path of the index and its count, through the public queries."""
    found, stack = {}, [((), index.root)]
    while stack:
        path, node = stack.pop()
        for token, child in index.ranked(node):
            found[(*path, token)] = child.count
            stack.append(((*path, token), child))
    return found


def brute_dump(seqs, depth):
    return {
        tuple(seq[i : i + n]): occurrences(seqs, seq[i : i + n])
        for seq in seqs
        for i in range(len(seq))
        for n in range(1, min(depth, len(seq) - i) + 1)
    }


def built(seqs, depth, **options) -> SuffixIndex:
    index = SuffixIndex(depth, **options)
    for i, seq in enumerate(seqs):
        index.add(i, seq)
    return index


@pytest.mark.parametrize("seed,vocab,depth", CASES)
def test_counts_equal_a_scan_of_the_sequences_built_at_once_or_token_by_token(seed, vocab, depth):
    seqs = texts(seed, vocab)
    assert dump(built(seqs, depth)) == brute_dump(seqs, depth)
    index, rng = SuffixIndex(depth), random.Random(seed)
    for i in range(len(seqs)):
        index.add(i, [])
    grown = [[] for _ in seqs]
    while any(
        len(g) < len(s) for g, s in zip(grown, seqs, strict=True)
    ):  # interleaved chunks, queried between
        i = rng.choice([i for i, s in enumerate(seqs) if len(grown[i]) < len(s)])
        chunk = seqs[i][len(grown[i]) : len(grown[i]) + rng.randrange(1, 4)]
        index.extend(i, chunk)
        grown[i] += chunk
        index.draft_tree(grown[i], 6)  # a query expands nodes: it must not change what is counted
        assert dump(index) == brute_dump(grown, depth)


@pytest.mark.parametrize("seed,vocab,depth", CASES)
def test_match_and_continuations_equal_brute_force(seed, vocab, depth):
    seqs = texts(seed, vocab)
    index, rng = built(seqs, depth), random.Random(seed + 100)
    contexts = [s[: rng.randrange(len(s) + 1)] for s in seqs] + [
        [rng.randrange(vocab + 1) for _ in range(rng.randrange(12))] for _ in range(20)
    ]
    for context in contexts:
        length, node = index.match(context)
        assert length == brute_match(seqs, context, depth, vocab)
        pattern = context[len(context) - length :] if length else []
        assert index.continuations(node) == brute_continuations(seqs, pattern, depth, vocab)


def brute_tree(seqs, context, depth, vocab, *, max_nodes, min_prob, chain=False):
    """Best-first expansion by product of frequency ratios, every count by scanning the sequences."""
    pattern = context[len(context) - brute_match(seqs, context, depth, vocab) :]
    tokens, parents, scores, heap, order = [], [], [], [], itertools.count()

    def offer(path, index, score):
        total = occurrences(seqs, path) if path else sum(map(len, seqs))
        for rank, (token, count) in enumerate(brute_continuations(seqs, path, depth, vocab)):
            if score * (count / total) >= min_prob and (rank == 0 or not chain):
                heapq.heappush(heap, (-score * (count / total), next(order), token, index, [*path, token]))

    offer(pattern, -1, 1.0)
    while heap and len(tokens) < max_nodes:
        neg, _, token, parent, path = heapq.heappop(heap)
        tokens.append(token), parents.append(parent), scores.append(-neg)
        offer(path, len(tokens) - 1, -neg)
    return tokens, parents, scores


@pytest.mark.parametrize("seed,vocab,depth", CASES)
@pytest.mark.parametrize("min_prob", [0.0, 0.1, 0.4])
def test_chains_and_trees_equal_brute_force(seed, vocab, depth, min_prob):
    seqs = texts(seed, vocab)
    index, rng = built(seqs, depth), random.Random(seed + 200)
    for _ in range(15):
        seq = rng.choice(seqs)
        context = seq[: rng.randrange(len(seq) + 1)]
        for chain, size in ((True, 5), (False, 1), (False, 9)):
            draft = (
                index.draft_chain(context, size, min_prob)
                if chain
                else index.draft_tree(context, size, min_prob)
            )
            tokens, parents, scores = brute_tree(
                seqs, context, depth, vocab, max_nodes=size, min_prob=min_prob, chain=chain
            )
            assert (draft.tokens, draft.parents) == (tokens, parents)
            assert draft.scores == pytest.approx(scores)
            assert draft.match_length == brute_match(seqs, context, depth, vocab)
            for i, parent in enumerate(draft.parents):  # a score is the product of the ratios from the root
                assert draft.scores[i] == pytest.approx(
                    draft.probs[i] * (draft.scores[parent] if parent >= 0 else 1)
                )


def test_a_tree_draft_is_wider_than_its_chain_where_continuations_branch():
    index = built([[1, 2, 3], [1, 2, 4], [1, 2, 3]], 8)
    assert index.draft_chain([0, 1], 4).tokens == [2, 3]
    tree = index.draft_tree([0, 1], 4)
    assert (tree.tokens, tree.parents) == ([2, 3, 4], [-1, 0, 0])
    assert tree.scores == pytest.approx([1.0, 2 / 3, 1 / 3])
    assert index.draft_tree([0, 1], 4, min_prob=0.5).tokens == [2, 3]
    assert index.match([1, 2])[0] == 2 and index.match([1, 2], max_length=1)[0] == 1
    assert index.match([9, 9])[0] == 0 and index.draft_chain([9], 4).tokens == [1, 2, 3]  # from the root


@pytest.mark.parametrize("seed,vocab,depth", CASES[:8])
def test_removal_and_eviction_restore_the_counts_exactly(seed, vocab, depth):
    seqs = texts(seed, vocab, count=5)
    index = built(seqs, depth)
    index.draft_tree(seqs[1], 20)  # expand some nodes first
    index.remove(1)
    rest = [s for i, s in enumerate(seqs) if i != 1]
    assert dump(index) == dump(built(rest, depth)) == brute_dump(rest, depth)
    bounded = built(seqs, depth, max_sequences=3)
    assert len(bounded) == 3 and dump(bounded) == brute_dump(seqs[2:], depth)
    bounded.extend(4, [0, 1, 0])
    assert dump(bounded) == brute_dump([*seqs[2:4], seqs[4] + [0, 1, 0]], depth)


@pytest.mark.parametrize("eos,chain,tree", [("before", [2], [2, 5]), ("after", [2, 9], [2, 9, 5])])
def test_drafts_never_go_past_a_stop_token(eos, chain, tree):
    index = built([[1, 2, 9, 3], [1, 2, 9, 4], [1, 2, 5, 6]], 8, stop={9}, eos=eos)
    assert index.draft_chain([1], 6).tokens == chain
    assert index.draft_tree([1], 6).tokens == tree + [6]
    assert 9 in dict(index.continuations(index.match([1, 2])[1]))  # raw continuations keep it


def test_file_round_trip_keeps_every_count_and_extends_on(tmp_path):
    seqs = texts(7, 4)
    index = built(seqs, 6, max_sequences=10)
    index.draft_tree(seqs[0], 10)
    path = save_index(tmp_path / "corpus.sfx", index, fingerprint={"vocab_hash": "abc", "size": 4})
    loaded = load_index(path, fingerprint={"size": 4, "vocab_hash": "abc"})
    assert dump(loaded) == dump(index) and loaded.max_sequences == 10 and len(loaded) == len(seqs)
    loaded.extend(2, [1, 1, 2, 3])
    loaded.add("new", [3, 2, 1])
    seqs[2] += [1, 1, 2, 3]
    assert dump(loaded) == brute_dump([*seqs, [3, 2, 1]], 6)
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.sfx"]  # no temporary left behind


def damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "flip_body":
        data[-5] ^= 0x01
    elif how == "flip_header":
        data[data.index(b'"max_depth": ') + len(b'"max_depth": ')] ^= 0x01  # 6 -> 7: still valid JSON
    elif how == "truncate":
        data = data[:-9]
    elif how == "version":
        data = data.replace(b'"version": 1', b'"version": 9', 1)
    elif how == "other_file":
        data = b"def f():\n    return 1\n"
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how,error,words",
    [
        ("flip_body", SuffixIndexDamagedError, "checksum"),
        ("flip_header", SuffixIndexDamagedError, "checksum"),
        ("truncate", SuffixIndexDamagedError, "truncated"),
        ("version", SuffixIndexVersionError, "version 9"),
        ("other_file", NotASuffixIndexError, "not a suffix index"),
        ("missing", NotASuffixIndexError, "cannot read"),
    ],
)
def test_a_damaged_or_foreign_file_is_refused_by_name(tmp_path, how, error, words):
    path = save_index(tmp_path / "corpus.sfx", built(texts(3, 4), 6), fingerprint="tok-A")
    if how == "missing":
        path.unlink()
    else:
        damage(path, how)
    with pytest.raises(error, match=words) as caught:
        load_index(path, fingerprint="tok-A")
    assert (
        isinstance(caught.value, UserError)
        and str(path) in str(caught.value)
        and "rebuild" in str(caught.value)
    )


def test_an_index_built_for_another_tokenizer_is_refused(tmp_path):
    path = save_index(tmp_path / "corpus.sfx", built(texts(3, 4), 6), fingerprint={"vocab_hash": "A"})
    with pytest.raises(SuffixIndexFingerprintError, match="another tokenizer") as caught:
        load_index(path, fingerprint={"vocab_hash": "B"})
    assert str(path) in str(caught.value)


def test_ranked_children_follow_every_change_of_the_counts():
    """``ranked`` is memoised per node: extending, adding and removing must each show in the next ranking."""
    index = SuffixIndex(8)
    index.add("a", [5, 1, 5, 2])
    node = index.find([5])
    assert index.continuations(node) == [(1, 1), (2, 1)]
    index.extend("a", [5, 2])  # 5 -> 2 twice now
    assert index.continuations(index.find([5])) == [(2, 2), (1, 1)]
    index.add("b", [5, 1, 5, 1, 5, 1])
    assert index.continuations(index.find([5])) == [(1, 4), (2, 2)]
    index.remove("b")
    assert index.continuations(index.find([5])) == [(2, 2), (1, 1)]


def retained(index: SuffixIndex) -> tuple[int, int]:
    """(nodes held below the root, children held by ranking memos: on the nodes, or in the index's own)."""
    nodes, stack, memoised = 0, [index.root], 0
    while stack:
        node = stack.pop()
        nodes += node is not index.root
        memoised += len(node.order[1]) if node.order is not None else 0
        stack.extend((node.children or {}).values())
    memo = getattr(index, "memo", None)
    return nodes, memoised + (memo.size if memo is not None else 0)


def every_draft(index: SuffixIndex, contexts: list[list[int]]) -> list[tuple]:
    return [
        (d.tokens, d.parents, d.scores, d.match_length)
        for context in contexts
        for d in (index.draft_chain(context, 8, 0.0), index.draft_tree(context, 12, 0.0))
    ]


def test_queries_do_not_grow_a_corpus_read_from_a_file(tmp_path):
    """A corpus index (``corpus_index``: one per file version, shared by every caller) is as its file left it
    after many distinct queries: no node expanded, its ranking memo within its bound; its drafts are a plain
    index's, which the same queries do grow (was: every read expanded nodes and kept memos on them)."""
    seqs = texts(11, 6, count=8)  # long random texts: most of their paths are unexpanded chains when saved
    fingerprint = {"vocab_size": 6, "vocab_hash": "h"}
    path = save_index(tmp_path / "corpus.sfx", built(seqs, 64), fingerprint=fingerprint)
    corpus = corpus_index(path, SimpleNamespace(vocab_size=6))
    plain = load_index(path, fingerprint=fingerprint)
    rng = random.Random(5)
    contexts = [seq[:end] for seq in seqs for end in range(len(seq) + 1)]
    contexts += [[rng.randrange(6) for _ in range(rng.randrange(1, 12))] for _ in range(200)]
    loaded, plain_loaded = retained(corpus), retained(plain)
    assert loaded == plain_loaded and loaded[1] == 0
    assert every_draft(corpus, contexts) == every_draft(plain, contexts)
    assert retained(plain)[0] > plain_loaded[0]  # the same queries expand a plain index's nodes
    assert retained(corpus)[0] == loaded[0]
    corpus.memo.resize(10)  # a bound the memo reaches: the least recently used rankings go
    assert every_draft(corpus, contexts) == every_draft(plain, contexts)
    assert 0 < corpus.memo.size <= 10 and retained(corpus)[0] == loaded[0]
    with pytest.raises(TypeError, match="read only"):
        corpus.add("new", [1, 2])


@pytest.mark.parametrize("eos", ["before", "after"])
def test_a_corpus_drafts_with_each_callers_eos_ids_from_one_load(tmp_path, eos):
    """``corpus_index(path, m, stop=, eos=)``: views of the one index loaded for the file, each drafting as an
    index built with its EOS ids and rule."""
    seqs = [[1, 2, 9, 3], [1, 2, 9, 4], [1, 2, 5, 6], *texts(3, 10)]
    fingerprint = {"vocab_size": 10, "vocab_hash": "h"}
    path = save_index(tmp_path / "corpus.sfx", built(seqs, 8), fingerprint=fingerprint)
    m = SimpleNamespace(vocab_size=10)
    stopped, free = corpus_index(path, m, stop={9}, eos=eos), corpus_index(path, m)
    assert stopped.root is free.root  # one load
    contexts = [[1], [1, 2], *[seq[:end] for seq in seqs for end in range(len(seq))]]
    assert every_draft(stopped, contexts) == every_draft(built(seqs, 8, stop={9}, eos=eos), contexts)
    assert every_draft(free, contexts) == every_draft(built(seqs, 8), contexts)
