"""Token trees: the pure functions that verify many candidate continuations in one target pass.

A tree draft (``speculative.Draft.parents``) holds k nodes after the last accepted token t, parents before
children, siblings with distinct tokens. ``ancestor_mask`` and ``position_depths`` lay it out for one
forward; ``greedy_walk`` and ``sample_walk`` accept one branch (greedy: the longest the target agrees with;
sampling: multi-candidate speculative sampling, lossless); ``path_order`` and ``node_depth`` linearise it.
``row_depths`` is the one home of a node's depth. Derivations: docs/design/decoding.md.
"""

from __future__ import annotations

import torch


def row_depths(row: list[int]) -> list[int]:
    """One row's node depths (1: a child of t) from its parent indices (-1: t; parents come first)."""
    found: list[int] = []
    for parent in row:
        found.append(1 if parent < 0 else found[parent] + 1)
    return found


def depths(parents: torch.Tensor) -> torch.Tensor:
    """``parents [B, k]`` -> ``[B, k]`` long: each node's depth (a child of t: 1)."""
    rows = [row_depths(row) for row in parents.tolist()]
    return torch.tensor(rows, dtype=torch.long, device=parents.device).reshape(parents.shape)


def ancestor_mask(parents: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """``parents [B, k]`` -> ``[B, W, W]`` bool over the positions ``[t, d1..dk, extra..]``: entry ``[q, s]``
    is True iff position s is q itself or one of its ancestors. ``width`` W >= k + 1 (default k + 1) adds
    padding positions after the drafts; each hangs off t (attends to t and itself), so no draft attends to it
    and it attends to no draft. Built on the host: a tree is a few dozen nodes, and per-node device ops
    cost more than the whole list work on a CPU."""
    batch, k = parents.shape
    width = k + 1 if width is None else width
    if width < k + 1:
        raise ValueError(f"width {width} is less than the {k + 1} positions of t and {k} drafts")
    masks = []
    for row in parents.tolist():
        mask = [[s == 0 or s == q for s in range(width)] for q in range(width)]
        for j, parent in enumerate(row):
            if parent >= 0:
                mask[j + 1] = [a or b for a, b in zip(mask[j + 1], mask[parent + 1], strict=True)]
        masks.append(mask)
    return torch.tensor(masks, dtype=torch.bool, device=parents.device).reshape(batch, width, width)


def position_depths(parents: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, W]`` long: the depth of each of the ``width`` verified positions (t: 0, padding hanging off t: 1),
    what is added to t's position for rotary embeddings and the cache's key positions."""
    k = parents.shape[1]
    rows = [[0, *row_depths(row), *[1] * (width - k - 1)] for row in parents.tolist()]
    return torch.tensor(rows, dtype=torch.long, device=parents.device).reshape(parents.shape[0], width)


def greedy_walk(
    tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """The deepest node of the longest branch the target agrees with: ``[B]`` long (-1: t, no draft).

    ``tokens, parents, valid [B, k]`` (valid: the nodes each row drafted), ``target [B, k+1]`` the target's
    argmax at ``[t, d1..dk]``. A node matches when its token is the argmax at its parent; at most one child of
    a node matches (distinct siblings), and parents come first, so one pass in draft order walks the branch."""
    found = []
    rows = zip(tokens.tolist(), parents.tolist(), valid.tolist(), target.tolist(), strict=True)
    for row_tokens, row_parents, row_valid, row_target in rows:
        node = -1
        for j, (token, parent, ok) in enumerate(zip(row_tokens, row_parents, row_valid, strict=True)):
            if ok and parent == node and token == row_target[parent + 1]:
                node = j
        found.append(node)
    return torch.tensor(found, dtype=torch.long, device=tokens.device)


def sample_walk(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-candidate speculative sampling of deterministic candidates: at a node, accept child ci with
    probability p(ci) / sum(p), else remove ci's mass from p; all rejected: the next token is drawn from
    what is left (why this is lossless: docs/design/decoding.md).

    ``tokens, parents, valid [B, k]``; ``p [B, k+1, V]`` the target's distributions (after the sampling
    processing) at ``[t, d1..dk]``; ``uniforms [B, k]`` in [0, 1), one acceptance test per node. Returns
    ``(node [B], residual [B, V])``: the deepest accepted node (-1: t) and the unnormalised distribution the
    next token is drawn from (what is left of p at that node after its rejected children; p itself at an
    accepted leaf: the bonus). A token of probability 0 is never accepted (strict test)."""
    node = tokens.new_full((tokens.shape[0],), -1)
    residual = p[:, 0].clone()
    for j in range(tokens.shape[1]):
        token = tokens[:, j : j + 1]
        child = valid[:, j] & (parents[:, j] == node)
        mass = residual.gather(-1, token)[:, 0]
        take = child & (uniforms[:, j] * residual.sum(-1) < mass)
        reject = child & ~take
        residual = torch.where(reject[:, None], residual.scatter(-1, token, 0.0), residual)
        residual = torch.where(take[:, None], p[:, j + 1], residual)
        node = torch.where(take, j, node)
    return node, residual


def _branch(row: list[int], node: int) -> list[int]:
    """The nodes from t's child down to ``node`` (-1: none), in depth order."""
    found = []
    while node >= 0:
        found.append(node)
        node = row[node]
    return found[::-1]


def path_order(parents: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """``[B, k]`` long, a permutation of the k nodes per row: the branch from t to ``node [B]`` (-1: none)
    first, in depth order (= node order: parents come first), then every other node in draft order. Slot
    ``i`` of the linearised draft takes node ``order[:, i]``."""
    orders = []
    for row, end in zip(parents.tolist(), node.tolist(), strict=True):
        branch = _branch(row, end)
        on = set(branch)
        orders.append(branch + [j for j in range(len(row)) if j not in on])
    return torch.tensor(orders, dtype=torch.long, device=parents.device).reshape(parents.shape)


def node_depth(parents: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """``[B]`` long: the depth of ``node [B]`` (-1, i.e. t: 0): the drafts a branch ending there accepts."""
    found = [len(_branch(row, end)) for row, end in zip(parents.tolist(), node.tolist(), strict=True)]
    return torch.tensor(found, dtype=torch.long, device=parents.device)


def chain_parents(batch: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B, k]``: the parents of a chain (node j's parent is j - 1), a tree draft's degenerate case."""
    return (torch.arange(k, device=device) - 1).expand(batch, -1).clone()
