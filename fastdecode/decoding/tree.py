"""Token trees: verifying many candidate continuations in one target pass (SpecInfer, Miao et al. 2024;
Medusa, Cai et al. 2024; EAGLE-2, Li et al. 2024).

A tree draft (``speculative.Draft.parents``) holds k nodes after the last accepted token t; node j's parent is
``parents[:, j]`` (-1: t), a parent comes before its children and siblings carry distinct tokens. The target
scores [t, d1..dk] in one forward where each position attends only to its ancestors (``ancestor_mask``) at
the position of its depth (``depths``), so each node's logits are those of the sequence along its branch.
Then one branch is accepted:

- greedy (``greedy_walk``): from t, follow the child whose token is the target's argmax at its parent; the
  longest matching branch. Exactly the tokens plain greedy decoding would emit.
- sampling (``sample_walk``): multi-candidate speculative sampling for deterministic candidates (SpecInfer;
  EAGLE's tree sampling): at a node with target distribution p and children c1..cm in draft order, accept
  ci with probability p(ci) / sum(p); on rejection remove ci's mass from p (p <- max(p - onehot(ci), 0),
  renormalised implicitly); all rejected: the next token is drawn from what is left. Why lossless: the first
  child is emitted with probability p(c1); given its rejection the residual is p conditioned on "not c1",
  so by induction every token x is emitted with probability p(x) (distinct siblings make the removals
  disjoint), and an accepted child continues from the target's own distribution at its position.

Everything here is a pure function over tensors (the loop, the caches and the compaction of the accepted
branch are ``speculative.py``'s and ``cache.py``'s). Loops run over the k nodes (k is a draft's length, a
few dozen at most), vectorised over the batch: no host sync.
"""

from __future__ import annotations

import torch


def depths(parents: torch.Tensor) -> torch.Tensor:
    """``parents [B, k]`` -> ``[B, k]`` long: each node's depth (a child of t: 1)."""
    out = torch.zeros_like(parents)
    for j in range(parents.shape[1]):
        above = out.gather(1, parents[:, j : j + 1].clamp_min(0))[:, 0]
        out[:, j] = torch.where(parents[:, j] < 0, 1, above + 1)
    return out


def ancestor_mask(parents: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """``parents [B, k]`` -> ``[B, W, W]`` bool over the positions ``[t, d1..dk, extra..]``: entry ``[q, s]``
    is True iff position s is q itself or one of its ancestors. ``width`` W >= k + 1 (default k + 1) adds
    padding positions after the drafts; each hangs off t (attends to t and itself), so no draft attends to it
    and it attends to no draft."""
    batch, k = parents.shape
    width = k + 1 if width is None else width
    if width < k + 1:
        raise ValueError(f"width {width} is less than the {k + 1} positions of t and {k} drafts")
    eye = torch.eye(width, dtype=torch.bool, device=parents.device)
    mask = eye.expand(batch, -1, -1).clone()
    mask[:, :, 0] = True  # every position descends from t
    for j in range(k):
        above = mask.gather(1, (parents[:, j] + 1)[:, None, None].expand(-1, 1, width))[:, 0]
        mask[:, j + 1] |= above
    return mask


def position_depths(parents: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, W]`` long: the depth of each of the ``width`` verified positions (t: 0, padding hanging off t: 1),
    what is added to t's position for rotary embeddings and the cache's key positions."""
    batch, k = parents.shape
    pad = torch.ones(batch, width - k - 1, dtype=torch.long, device=parents.device)
    return torch.cat([pad[:, :0].new_zeros(batch, 1), depths(parents), pad], 1)


def greedy_walk(
    tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """The deepest node of the longest branch the target agrees with: ``[B]`` long (-1: t, no draft).

    ``tokens, parents, valid [B, k]`` (valid: the nodes each row drafted), ``target [B, k+1]`` the target's
    argmax at ``[t, d1..dk]``. A node matches when its token is the argmax at its parent; at most one child of
    a node matches (distinct siblings), and parents come first, so one pass in draft order walks the branch."""
    expected = target.gather(1, parents + 1)  # [B, k]: the argmax at each node's parent
    match = valid & (tokens == expected)
    node = tokens.new_full((tokens.shape[0],), -1)
    for j in range(tokens.shape[1]):
        node = torch.where(match[:, j] & (parents[:, j] == node), j, node)
    return node


def sample_walk(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-candidate speculative sampling of deterministic candidates (the module docstring's rule).

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


def path_order(parents: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """``[B, k]`` long, a permutation of the k nodes per row: the branch from t to ``node [B]`` (-1: none)
    first, in depth order (= node order: parents come first), then every other node in draft order. Slot
    ``i`` of the linearised draft takes node ``order[:, i]``."""
    k = parents.shape[1]
    branch = ancestor_mask(parents).gather(1, (node + 1)[:, None, None].expand(-1, 1, k + 1))[:, 0, 1:]
    index = torch.arange(k, device=parents.device).expand_as(parents)
    return torch.where(branch, index, index + k).argsort(-1)


def node_depth(parents: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """``[B]`` long: the depth of ``node [B]`` (-1, i.e. t: 0): the drafts a branch ending there accepts."""
    root = parents.new_zeros(parents.shape[0], 1)
    return torch.cat([root, depths(parents)], 1).gather(1, (node + 1)[:, None])[:, 0]


def chain_parents(batch: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B, k]``: the parents of a chain (node j's parent is j - 1), a tree draft's degenerate case."""
    return (torch.arange(k, device=device) - 1).expand(batch, -1).clone()
