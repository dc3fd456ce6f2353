"""Prompt lookup as a token tree (``decoder.lookup.tree=true``): where the row's last n tokens occurred
several times before with different continuations, draft them all at once, merged into one trie.

``OccurrenceIndex`` keeps up to ``decoder.lookup.occurrences`` occurrences per n-gram; ``continuations``
weighs their continuations (``vote``), ``merge`` builds the trie (``LookupTree``), ``best_first`` orders its
nodes by the estimated probability that their path is right, and ``TreeLookupProposer`` drafts each row's
best nodes within the batch's node budget. Derivations: docs/design/drafters.md.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.speculative import Draft, Round
from fastdecode.drafters.lookup.ngram import NgramIndex, PromptLookupProposer
from fastdecode.drafters.lookup.options import LookupOptions
from fastdecode.plan.acceptance import MATCH_PRIOR
from fastdecode.plan.cost import CostModel, best_node_budget


class OccurrenceIndex(NgramIndex):
    """``NgramIndex`` plus, per n and n-gram, the starts of up to ``keep`` occurrences with a continuation:
    the most recent first (``match="recent"``) or the first ones in order (``"earliest"``). The chain lookup
    (``lookup``) answers as ``NgramIndex``'s does."""

    def __init__(
        self,
        max_n: int,
        *,
        keep: int = 4,
        match: str = "recent",
        stop: Iterable[int] = (),
        eos: str = "before",
    ) -> None:
        super().__init__(max_n, match=match, stop=stop, eos=eos)
        if keep < 1:
            raise ValueError(f"keep={keep}: need at least one occurrence per n-gram")
        self.keep = keep
        self.occurrences: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n + 1)]

    def extend(self, new: list[int]) -> None:
        for token in new:
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                starts = self.occurrences[n].setdefault(tuple(self.tokens[end - n : end]), [])
                if not self.earliest:
                    starts.insert(0, end - n)
                    del starts[self.keep :]
                elif len(starts) < self.keep:
                    starts.append(end - n)
            super().extend([token])

    def starts_of(self, n: int) -> list[int]:
        """The kept occurrences (starts) of the row's last n tokens; [] when there are none."""
        if not 1 <= n <= min(self.max_n, len(self.tokens) - 1):
            return []
        return list(self.occurrences[n].get(tuple(self.tokens[len(self.tokens) - n :]), []))


# How much one occurrence of a shorter match weighs against one of the longest match n: as much as its first
# drafted token lands, relative (``MATCH_PRIOR``'s first column: a 1-token match's lands 0.21 / 0.90 as often as a
# 4-token match's).
def vote(n: int, longest: int) -> float:
    first = MATCH_PRIOR.get(n, MATCH_PRIOR[max(MATCH_PRIOR)])[0]
    return first / MATCH_PRIOR.get(longest, MATCH_PRIOR[max(MATCH_PRIOR)])[0]


@dataclass
class Continuation:
    """One occurrence's continuation: ``tokens`` (cut at EOS and the limit), the ``weight`` of its vote,
    ``stopped``: it was cut before an EOS (a vote for a token the tree does not draft)."""

    tokens: list[int]
    weight: float
    stopped: bool = False


def continuations(
    index: OccurrenceIndex, min_n: int, limit: int, *, shorter: bool = False
) -> tuple[list[Continuation], int]:
    """``(continuations, n)`` of the longest matching n (``n`` 0 and none when nothing matches), and with
    ``shorter`` those of the shorter n down to ``min_n`` whose continuation starts at a new position."""
    tokens, found, seen, longest = index.tokens, [], set(), 0
    for n in range(min(index.max_n, len(tokens) - 1), min_n - 1, -1):
        if longest and not shorter:
            break
        starts = index.starts_of(n)
        if not starts:
            continue
        longest = longest or n
        for start in starts:
            if start + n in seen:
                continue
            seen.add(start + n)
            raw = tokens[start + n : start + n + limit]
            cut = index.cut(raw)
            stopped = len(cut) < len(raw) and index.before
            found.append(Continuation(cut, vote(n, longest), stopped))
    return found, longest


@dataclass
class LookupTree:
    """A trie of continuations, N nodes in insertion order (parents first): ``tokens`` [N], ``parents`` [N]
    (-1: after the row's last token), ``depths`` [N] (0: a child of the root), ``weights`` [N] (the votes
    through the node), ``totals`` [N + 1] (the votes going on past each node, children or an EOS not
    drafted; the last entry is the root's), ``n`` (the match length)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    totals: list[float] = field(default_factory=lambda: [0.0])
    n: int = 0


def merge(found: list[Continuation], n: int) -> LookupTree:
    """The trie of ``found``: shared prefixes merged, so siblings carry distinct tokens."""
    tree = LookupTree(n=n)
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for item in found:
        parent = -1
        for token in item.tokens:
            tree.totals[parent] += item.weight
            node = children.get((parent, token))
            if node is None:
                node = len(tree.tokens)
                children[(parent, token)] = node
                tree.tokens.append(token)
                tree.parents.append(parent)
                tree.weights.append(0.0)
                tree.depths.append(tree.depths[parent] + 1 if parent >= 0 else 0)
                tree.totals.insert(-1, 0.0)
            tree.weights[node] += item.weight
            parent = node
        if item.stopped:
            tree.totals[parent] += item.weight
    return tree


def best_first(tree: LookupTree, acceptance: list[float], limit: int) -> tuple[list[int], list[float]]:
    """``(nodes, probs)``: at most ``limit`` nodes of ``tree`` by the estimated probability that their path
    is right, P(child) = P(parent) * a(n, i) * w / W (``acceptance[i]``: a(n, i); w / W: the child's share of
    the votes past its parent), highest first, ties by insertion order. Every node comes after its parent,
    so any prefix is a tree."""
    kids: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents):
        kids.setdefault(parent, []).append(node)
    heap: list[tuple[float, int]] = []

    def offer(parent: int, prob: float) -> None:
        for node in kids.get(parent, []):
            share = tree.weights[node] / tree.totals[parent]
            heapq.heappush(heap, (-prob * acceptance[tree.depths[node]] * share, node))

    offer(-1, 1.0)
    nodes, probs = [], []
    while heap and len(nodes) < limit:
        neg, node = heapq.heappop(heap)
        nodes.append(node)
        probs.append(-neg)
        offer(node, -neg)
    return nodes, probs


@dataclass
class RowTree:
    """One row's drafted tree, best first: ``tokens`` [N], ``parents`` [N] (among these N; -1: after the
    row's last token), ``probs`` [N] (estimated path probabilities), ``n`` (match length; 0: no draft)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    n: int = 0

    def prefix(self, width: int) -> RowTree:
        """Its first ``width`` nodes (a tree: parents come first)."""
        n = self.n if width > 0 and self.tokens else 0
        cut = slice(0, width)
        return RowTree(self.tokens[cut], self.parents[cut], self.probs[cut], self.depths[cut], n)


def row_tree(tree: LookupTree, acceptance: list[float], limit: int) -> RowTree:
    """The best ``limit`` nodes of ``tree`` (``best_first``), parents renumbered among them."""
    nodes, probs = best_first(tree, acceptance, limit)
    position = {node: j for j, node in enumerate(nodes)}
    parents = [position[tree.parents[node]] if tree.parents[node] >= 0 else -1 for node in nodes]
    depths = [tree.depths[node] for node in nodes]
    return RowTree([tree.tokens[node] for node in nodes], parents, probs, depths, tree.n if nodes else 0)


class TreeLookupProposer(PromptLookupProposer):
    """Prompt lookup drafting a token tree per row (``decoder.lookup.tree``): the merged continuations of up
    to ``decoder.lookup.occurrences`` occurrences, at most ``Round.limit`` nodes, with a cost-aware policy at
    the batch's best node budget (``cost.best_node_budget``). ``stats``: its own acceptance, booked along the
    accepted path (``learn``)."""

    name = "prompt_lookup"

    def __init__(
        self, prompts: list[list[int]], cfg: DecodeConfig, costs: CostModel, vocab_size: int
    ) -> None:
        super().__init__(prompts, cfg, costs, vocab_size)
        o = LookupOptions.of(cfg)
        kept = {"keep": o.occurrences, "match": o.match, "stop": cfg.eos_ids, "eos": o.eos}
        self.indexes = [OccurrenceIndex(o.max_ngram_size, **kept) for _ in prompts]
        self.depths: list[int] = [0] * len(prompts)  # levels of each row's last tree

    def tree(self, r: Round, row: int) -> RowTree:
        """The row's tree of at most ``r.limit`` nodes, best first; empty when not decoding or no match."""
        if r.rows.finished[row] or r.limit <= 0:
            return RowTree()
        index = self._sync(row, r.rows.tokens[row])
        found, n = continuations(index, self.options.min_ngram_size, r.limit, shorter=self.options.shorter)
        tree = merge(found, n)
        return row_tree(tree, self.stats.estimate(n, r.limit), r.limit) if n else RowTree()

    def trees(self, r: Round) -> list[RowTree]:
        """Every row's tree, with a cost-aware policy cut to the batch's node budget (``cost.best_node_budget``)."""
        trees = [self.tree(r, row) for row in range(len(r.rows.tokens))]
        if self.policy.cost_aware:
            live = [tree for row, tree in enumerate(trees) if not r.rows.finished[row]]
            width = best_node_budget(self.costs, [tree.probs for tree in live if tree.tokens], len(live))
            trees = [tree.prefix(width) for tree in trees]
        self.lengths = [len(tree.tokens) for tree in trees]
        self.matched = [tree.n for tree in trees]
        self.depths = [max(tree.depths, default=-1) + 1 for tree in trees]
        return trees

    def propose(self, r: Round) -> Draft:
        trees = self.trees(r)
        return self.propose_found(
            [tree.tokens for tree in trees], r.last.device, [tree.parents for tree in trees]
        )

    def learn(self, done) -> None:
        """Book each drafting row's accepted path: positions 0..accepted-1 landed, and position ``accepted``
        was tried and missed when the tree had a level there (``Settled.accepted``: tokens accepted along one
        path; a shallower branch ending on the path books that level too: a small, conservative bias)."""
        for row, (n, depth) in enumerate(zip(self.matched, self.depths, strict=True)):
            if n and done.accepted[row] is not None:
                accepted = min(done.accepted[row], depth)
                self.stats.add(n, accepted, depth)
