"""The suffix index of suffix drafting (SuffixDecoding, Oliaro et al., NeurIPS 2025): a trie over every
substring of at most ``max_depth`` tokens of some token sequences, each node counting its path's occurrences.

So the continuations of a text's longest matching suffix come with frequencies. ``SuffixIndex`` adds,
extends and removes sequences incrementally, matches a context, drafts a chain or a best-first tree that
never goes past a stop (EOS) token, and gives its state as flat lists for its file (``index_file.py``); its
``lock`` makes each of those one step for threads sharing it. Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

EOS_MODES = ("before", "after")


def locked(method: Callable) -> Callable:
    """``method`` of a ``SuffixIndex`` under its ``lock``: reads expand nodes and memoise rankings, so a read
    is a write too, and an index shared by threads (the global one, a corpus) is used one step at a time."""

    @functools.wraps(method)
    def call(self: SuffixIndex, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return call


class SuffixNode:
    """One path of the trie: its ``depth`` (tokens from the root), ``count`` (occurrences), ``children``
    (token -> node), or, while unexpanded, ``children=None`` and ``ref=(sequence key, end)``: its one
    occurrence ends at ``end`` in that sequence, whose later tokens are its implicit chain."""

    __slots__ = ("depth", "count", "children", "ref", "order")

    def __init__(self, depth: int, ref: tuple[int, int] | None = None, count: int = 1) -> None:
        self.depth, self.count, self.ref = depth, count, ref
        # (the index's ``version`` when ranked, its children ranked): ``SuffixIndex.ranked``'s memo
        self.order: tuple[int, list[tuple[int, SuffixNode]]] | None = None
        self.children: dict[int, SuffixNode] | None = None if ref is not None else {}


@dataclass
class SuffixDraft:
    """A draft tree of N nodes (a chain: ``parents == [-1, 0, 1, ...]``): ``tokens`` [N], ``parents`` [N]
    (index of the parent node, -1: the root, i.e. after the last context token; a parent comes before its
    children), ``probs`` [N] (child count / parent count), ``scores`` [N] (product of ``probs`` from the root:
    the estimated probability that the branch up to this node is right), ``match_length`` (tokens of the
    context that matched)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    match_length: int = 0


class SuffixIndex:
    """A bounded-depth suffix trie with counts over token sequences, added, extended and removed
    incrementally; ``max_sequences``, ``max_tokens``: keep at most that many sequences, tokens (checked as a
    sequence is added: the oldest added are evicted first, a sequence longer than ``max_tokens`` too; None:
    no bound). ``stop``: the EOS ids, never drafted past; ``eos="before"`` (the default, as prompt lookup's):
    a stop token is never proposed, ``"after"``: it is proposed and ends its branch. Thread-safe
    (``locked``)."""

    def __init__(
        self,
        max_depth: int = 64,
        *,
        max_sequences: int | None = None,
        max_tokens: int | None = None,
        stop: Iterable[int] = (),
        eos: str = "before",
    ) -> None:
        bounds = (max_sequences, max_tokens)
        if max_depth < 1 or any(b is not None and b < 1 for b in bounds) or eos not in EOS_MODES:
            raise ValueError(
                f"max_depth={max_depth}, max_sequences={max_sequences}, max_tokens={max_tokens}, "
                f"eos={eos!r}: need max_depth >= 1, max_sequences and max_tokens >= 1 or None, eos one of "
                f"{EOS_MODES}"
            )
        self.max_depth, self.max_sequences, self.max_tokens = max_depth, max_sequences, max_tokens
        self.lock = threading.RLock()
        self.stop, self.before = frozenset(int(t) for t in stop), eos == "before"
        self.root = SuffixNode(0)
        self.root.count = 0
        self.keys: dict[Hashable, int] = {}  # sequence id -> key, oldest first
        self.tokens: dict[int, list[int]] = {}  # key -> the sequence's tokens
        # key -> for each start whose path is under max_depth tokens (oldest first), a node on that path
        self.frontiers: dict[int, list[SuffixNode]] = {}
        self.next_key = 0
        self.version = 0  # bumped by every change of the counts: ``ranked``'s memo is valid while it holds

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def size(self) -> int:
        """The tokens indexed (every sequence's)."""
        return self.root.count

    @locked
    def add(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Index a new sequence ``tokens`` [T] under ``seq_id``; past ``max_sequences`` or ``max_tokens``,
        evict the oldest."""
        if seq_id in self.keys:
            raise ValueError(f"sequence {seq_id!r} is already indexed: extend or remove it")
        key = self.keys[seq_id] = self.next_key
        self.next_key += 1
        self.tokens[key], self.frontiers[key] = [], []
        self.extend(seq_id, tokens)
        sequences, most = self.max_sequences, self.max_tokens
        while self.keys and (
            (sequences is not None and len(self.keys) > sequences) or (most is not None and self.size > most)
        ):
            self.remove(next(iter(self.keys)))

    @locked
    def extend(self, seq_id: Hashable, new_tokens: Sequence[int]) -> None:
        """Append ``new_tokens`` [K] to the sequence ``seq_id`` and index the substrings they end."""
        key = self.keys[seq_id]
        tokens, frontier = self.tokens[key], self.frontiers[key]
        self.version += 1
        for token in new_tokens:
            token = int(token)
            p = len(tokens)  # the new token's position; after the append, frontier[k] is the start p-len+1+k
            frontier.append(self.root)
            self.root.count += 1
            # Newest start first: an expansion below then never materialises this token for an occurrence
            # (of an older start) that will count it itself in this same step.
            for k in range(len(frontier) - 1, -1, -1):
                frontier[k] = self._step(frontier[k], p - len(frontier) + 1 + k, tokens, token, key)
            if len(frontier) >= self.max_depth:
                frontier.pop(0)  # that start's path now has max_depth tokens
            tokens.append(token)

    def _step(self, node: SuffixNode, start: int, tokens: list[int], token: int, key: int) -> SuffixNode:
        """Count ``token`` (at position p = len(tokens)) on the path of ``start``, from a node on its path."""
        p = len(tokens)
        while node.children is not None and start + node.depth < p:
            node = node.children[tokens[start + node.depth]]  # counted before: it exists
        if node.children is None:
            return node  # its own unexpanded chain: this token joins it, counted implicitly
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = SuffixNode(node.depth + 1, (key, p + 1))
        else:
            child.count += 1
            if child.children is None:
                self._expand(child)
        return child

    def _expand(self, node: SuffixNode) -> dict[int, SuffixNode]:
        if node.children is None:
            key, end = node.ref
            node.ref, node.children = None, {}
            tokens = self.tokens[key]
            if node.depth < self.max_depth and end < len(tokens):
                node.children[tokens[end]] = SuffixNode(node.depth + 1, (key, end + 1))
        return node.children

    @locked
    def remove(self, seq_id: Hashable) -> None:
        """Remove the sequence ``seq_id`` and its counts (eviction); every other count stays as it was. The
        memos of the nodes whose children it changes go too: a stale one would keep removed nodes alive."""
        key = self.keys.pop(seq_id)
        tokens = self.tokens[key]
        self.version += 1
        self.root.count -= len(tokens)
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.max_depth]:
                node.order = None  # its ranking holds the child below, which may go now
                child = node.children[token]  # on our path: expanded unless count 1
                child.count -= 1
                if child.count == 0:
                    del node.children[token]  # with its subtree: ours alone
                    break
                node = child
        del self.tokens[key], self.frontiers[key]

    @locked
    def find(self, pattern: Sequence[int]) -> SuffixNode | None:
        """The node of ``pattern`` (at most ``max_depth`` tokens), None if it does not occur."""
        node: SuffixNode | None = self.root
        for token in pattern:
            node = self._expand(node).get(int(token))
            if node is None:
                return None
        return node

    @locked
    def match(self, context: Sequence[int], *, max_length: int | None = None) -> tuple[int, SuffixNode]:
        """``(length, node)`` of the longest suffix of ``context`` (at most ``max_length`` tokens, default
        ``max_depth - 1``) that occurs with at least one continuation; ``(0, root)`` if none does.

        Binary search on the length: if a suffix occurs with a continuation, so do its suffixes."""
        limit = min(len(context), self.max_depth - 1 if max_length is None else max_length, self.max_depth)
        found, lo, hi = (0, self.root), 1, limit
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self.find(context[len(context) - mid :])
            if node is not None and self._expand(node):
                found, lo = (mid, node), mid + 1
            else:
                hi = mid - 1
        return found

    @locked
    def continuations(self, node: SuffixNode) -> list[tuple[int, int]]:
        """``[(token, count)]`` of the tokens that followed ``node``'s path, most frequent first, ties by
        token id; stop tokens included."""
        return [(t, c.count) for t, c in self.ranked(node)]

    @locked
    def ranked(self, node: SuffixNode) -> list[tuple[int, SuffixNode]]:
        """``node``'s children as ``(token, child)``, most frequent first, ties by token id (not to be mutated).

        Memoised on the node until the counts change (``version``): the global index during a call ranks a
        node's children once (a short match's node may have thousands of them). A corpus memoises in a bounded
        LRU instead (``corpus.CorpusIndex``)."""
        memo = node.order
        if memo is not None and memo[0] == self.version:
            return memo[1]
        found = sorted(self._expand(node).items(), key=lambda item: (-item[1].count, item[0]))
        node.order = (self.version, found)
        return found

    @locked
    def draft_chain(self, context: Sequence[int], max_tokens: int, min_prob: float = 0.0) -> SuffixDraft:
        """From the longest match of ``context``, follow the most frequent child while the product of the
        ratios stays >= ``min_prob``, at most ``max_tokens`` tokens; a stop token ends it (``eos``)."""
        length, node = self.match(context)
        draft, score = SuffixDraft(match_length=length), 1.0
        while len(draft.tokens) < max_tokens:
            ranked = self.ranked(node)
            if not ranked:
                break
            token, child = ranked[0]
            prob = child.count / node.count
            if token in self.stop and self.before or score * prob < min_prob:
                break
            score *= prob
            draft.parents.append(len(draft.tokens) - 1)
            draft.tokens.append(token)
            draft.probs.append(prob)
            draft.scores.append(score)
            if token in self.stop:
                break
            node = child
        return draft

    @locked
    def draft_tree(self, context: Sequence[int], max_nodes: int, min_prob: float = 0.0) -> SuffixDraft:
        """Greedy best-first tree from the longest match of ``context``: repeatedly take the candidate (a
        child of the root or of a taken node) with the highest score (product of the ratios from the root),
        while it is >= ``min_prob``, up to ``max_nodes`` nodes. Ties: the candidate offered first (children
        of earlier nodes first, within a node by count then token id). Stop tokens: see ``eos``."""
        length, node = self.match(context)
        draft = SuffixDraft(match_length=length)
        heap: list[tuple[float, int, int, int, float, SuffixNode]] = []
        order = itertools.count()
        self._offer(heap, order, node, -1, score=1.0, min_prob=min_prob)
        while heap and len(draft.tokens) < max_nodes:
            neg, _, token, parent, prob, child = heapq.heappop(heap)
            draft.tokens.append(token)
            draft.parents.append(parent)
            draft.probs.append(prob)
            draft.scores.append(-neg)
            if token not in self.stop:
                self._offer(heap, order, child, len(draft.tokens) - 1, score=-neg, min_prob=min_prob)
        return draft

    def _offer(
        self,
        heap: list[Any],
        order: Iterator[int],
        node: SuffixNode,
        index: int,
        *,
        score: float,
        min_prob: float,
    ) -> None:
        for token, child in self.ranked(node):
            prob = child.count / node.count
            if score * prob >= min_prob and not (token in self.stop and self.before):
                heapq.heappush(heap, (-score * prob, next(order), token, index, prob, child))

    @locked
    def state(self) -> dict[str, list[Any]]:
        """What the index holds, as flat lists (for ``index_file``): ``ids`` [S] (oldest first),
        ``lengths`` [S], ``tokens`` [sum(lengths)] (the sequences one after another), and the nodes below the
        root in preorder: ``parent`` [M] (index of the parent node, -1: the root), ``token``, ``count``,
        ``ref_seq`` (index into ``ids`` of an unexpanded node's occurrence, -1: expanded), ``ref_end`` [M]."""
        order = {key: i for i, key in enumerate(self.keys.values())}
        out: dict[str, list[Any]] = {"ids": list(self.keys), "lengths": [], "tokens": []}
        for key in self.keys.values():
            out["lengths"].append(len(self.tokens[key]))
            out["tokens"].extend(self.tokens[key])
        columns = ("parent", "token", "count", "ref_seq", "ref_end")
        for column in columns:
            out[column] = []
        nodes = [out[column] for column in columns]
        stack = [(-1, token, child) for token, child in reversed(self.root.children.items())]
        while stack:
            parent, token, node = stack.pop()
            index = len(nodes[0])
            key, end = node.ref if node.ref is not None else (None, -1)
            for column, value in zip(
                nodes, (parent, token, node.count, order.get(key, -1), end), strict=True
            ):
                column.append(value)
            stack.extend((index, t, c) for t, c in reversed((node.children or {}).items()))
        return out

    @classmethod
    def from_state(cls, state: dict[str, list[Any]], max_depth: int, **options: Any) -> SuffixIndex:
        """The index ``state()`` described (``options``: the constructor's keywords). Raises ValueError on
        lists that do not describe an index (a parent after its child, a reference outside the sequences)."""
        index = cls(max_depth, **options)
        offsets = [0]
        for seq_id, length in zip(state["ids"], state["lengths"], strict=True):
            key = index.keys[seq_id] = index.next_key
            index.next_key += 1
            index.tokens[key] = [int(t) for t in state["tokens"][offsets[-1] : offsets[-1] + length]]
            index.frontiers[key] = [index.root] * min(length, max_depth - 1)  # walked down when extended
            offsets.append(offsets[-1] + length)
        if len(index.keys) != len(state["ids"]) or offsets[-1] != len(state["tokens"]):
            raise ValueError(
                "the sequences' ids are not distinct or their lengths do not add up to the tokens"
            )
        index.root.count = offsets[-1]
        nodes: list[SuffixNode] = []
        for parent, token, count, ref_seq, ref_end in zip(
            state["parent"], state["token"], state["count"], state["ref_seq"], state["ref_end"], strict=True
        ):
            if not -1 <= parent < len(nodes) or not -1 <= ref_seq < len(offsets) - 1 or count < 1:
                raise ValueError(f"node {len(nodes)} does not describe a node of an index")
            up = nodes[parent] if parent >= 0 else index.root
            ref = (ref_seq, ref_end) if ref_seq >= 0 else None
            node = up.children[token] = SuffixNode(up.depth + 1, ref, count)
            nodes.append(node)
        return index
