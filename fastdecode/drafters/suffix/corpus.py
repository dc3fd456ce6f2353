"""``CorpusIndex``: a suffix index read from a corpus file, shared by every caller's queries, which never grow it.

It refuses writes; a read that reaches an unexpanded node (one occurrence, its chain implicit in the sequence)
walks a transient child instead of expanding the node, and rankings are memoised in one LRU bounded in the
children it holds (``RankMemo``), not on the nodes. ``drafting(stop, eos)``: a view over the same nodes that
drafts with a call's EOS ids and rule, so one load serves every caller. Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from fastdecode.drafters.suffix.index import EOS_MODES, SuffixIndex, SuffixNode, locked

MEMO_CHILDREN = 1 << 20  # children held by a corpus's ranking memos at most (a few tens of MB)


class RankMemo:
    """Rankings of nodes (``SuffixIndex.ranked``), least recently used evicted first while they hold more than
    ``limit`` children in all; a ranking longer than ``limit`` is not kept. Guarded by its index's lock."""

    def __init__(self, limit: int = MEMO_CHILDREN) -> None:
        self.limit, self.size = limit, 0  # size: the children the kept rankings hold
        self.rankings: OrderedDict[SuffixNode, list[tuple[int, SuffixNode]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.rankings)

    def get(self, node: SuffixNode) -> list[tuple[int, SuffixNode]] | None:
        found = self.rankings.get(node)
        if found is not None:
            self.rankings.move_to_end(node)
        return found

    def put(self, node: SuffixNode, ranking: list[tuple[int, SuffixNode]]) -> None:
        if len(ranking) <= self.limit:
            self.rankings[node] = ranking
            self.size += len(ranking)
            self.resize(self.limit)

    def resize(self, limit: int) -> None:
        """Hold at most ``limit`` children from now on (the least recently used rankings dropped)."""
        self.limit = limit
        while self.size > limit:
            _, dropped = self.rankings.popitem(last=False)
            self.size -= len(dropped)


class CorpusIndex(SuffixIndex):
    """A read-only ``SuffixIndex`` (``from_state``: the file's); ``memo_children``: ``RankMemo``'s bound. Its
    nodes, memo and lock are shared by its ``drafting`` views."""

    def __init__(self, max_depth: int = 64, *, memo_children: int = MEMO_CHILDREN, **options: Any) -> None:
        super().__init__(max_depth, **options)
        self.memo = RankMemo(memo_children)

    def add(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        raise TypeError("a corpus index is read only: build another file with fastdecode-suffix-index")

    def extend(self, seq_id: Hashable, new_tokens: Sequence[int]) -> None:
        self.add(seq_id, new_tokens)

    def remove(self, seq_id: Hashable) -> None:
        self.add(seq_id, ())

    def drafting(self, stop: Iterable[int], eos: str) -> CorpusIndex:
        """This index drafting with the EOS ids ``stop`` and the rule ``eos`` (as ``SuffixIndex``'s): a view
        that shares its nodes, memo and lock (a shallow copy; nothing of it is written but the memo)."""
        if eos not in EOS_MODES:
            raise ValueError(f"eos={eos!r}: need one of {EOS_MODES}")
        view = copy.copy(self)
        view.stop, view.before = frozenset(int(t) for t in stop), eos == "before"
        return view

    def _expand(self, node: SuffixNode) -> dict[int, SuffixNode]:
        """``node``'s children; an unexpanded node's one child is made afresh, not kept (as the node it
        would be: count 1, the next token of the same occurrence)."""
        if node.children is not None:
            return node.children
        key, end = node.ref
        tokens = self.tokens[key]
        if node.depth < self.max_depth and end < len(tokens):
            return {tokens[end]: SuffixNode(node.depth + 1, (key, end + 1))}
        return {}

    @locked
    def ranked(self, node: SuffixNode) -> list[tuple[int, SuffixNode]]:
        """As ``SuffixIndex.ranked``, memoised in ``memo`` (the counts never change); an unexpanded node's at
        most one child is not worth a memo."""
        if node.children is None:
            return list(self._expand(node).items())
        found = self.memo.get(node)
        if found is None:
            found = sorted(node.children.items(), key=lambda item: (-item[1].count, item[0]))
            self.memo.put(node, found)
        return found
