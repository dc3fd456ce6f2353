"""EAGLE-2's dynamic draft trees (Li et al., 2024) drafted by the EAGLE-3 head (``decoder.eagle3.tree=true``).

``grow`` expands the tree level by level from the last accepted token's head row into a ``Pool``, each
frontier node offering its top-k children, until no deeper node could be kept (``Pool.settled``);
``Pool.best`` keeps the N nodes of highest path probability (a tree, since a path's probability is at most its
parent's), and ``node_budget`` picks N with a cost-aware policy. The caller crops the head's cache back
afterwards (``Eagle3Proposer.propose_tree``). Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

import torch

from fastdecode.plan.cost import CostModel, best_node_budget


class Pool:
    """Every node offered so far, in the order offered (parents first): per row ``tokens`` (draft ids),
    ``scores`` (log path probabilities) and ``parents`` (index in the pool; -1: t), each a list of ``[B, n]``."""

    def __init__(self) -> None:
        self.tokens: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []
        self.parents: list[torch.Tensor] = []
        self.size = 0

    def offer(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Add ``[B, n]`` nodes -> their pool indices ``[n]``."""
        self.tokens.append(tokens)
        self.scores.append(scores)
        self.parents.append(parents)
        index = torch.arange(self.size, self.size + tokens.shape[1], device=tokens.device)
        self.size += tokens.shape[1]
        return index

    def settled(self, frontier: torch.Tensor, keep: int) -> bool:
        """Whether no descendant of ``frontier`` (``[B, F]`` log path probabilities) can be among any row's
        ``keep`` best nodes: the pool holds ``keep`` nodes scoring at least the frontier's best (a child
        scores at most its parent, and a tie keeps the earlier node), so expanding further changes no
        ``best(width)`` with ``width <= keep``."""
        if keep <= 0 or self.size < keep:
            return keep <= 0
        bar = torch.cat(self.scores, 1).topk(keep, -1).values[:, -1]  # [B] each row's keep-th best
        return bool((frontier.max(-1).values <= bar).all())

    def best(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ``width`` best nodes per row, in pool order -> ``(tokens [B, N] draft ids, parents [B, N]
        among them (-1: t), log path probabilities [B, N])``. Ties keep the earlier node (a parent)."""
        tokens, scores, parents = (torch.cat(x, 1) for x in (self.tokens, self.scores, self.parents))
        order = torch.sort(-scores, dim=1, stable=True).indices[:, :width]
        chosen = order.sort(dim=1).values  # pool order: parents before children
        where = torch.full_like(scores, -1, dtype=torch.long)
        where.scatter_(1, chosen, torch.arange(width, device=scores.device).expand_as(chosen))
        parent = parents.gather(1, chosen)
        renumbered = torch.where(parent >= 0, where.gather(1, parent.clamp(min=0)), -1)
        return tokens.gather(1, chosen), renumbered, scores.gather(1, chosen)


def tree_keys(committed: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """The head's attention mask for the frontier's rows: ``committed [B, S]`` (the head cache's valid
    committed slots), ``ancestors [B, F, R]`` (the earlier tree rows each frontier node descends from) ->
    bool ``[B, 1, F, S + R + F]``: the committed rows, the node's ancestors' rows and its own."""
    batch, frontier, _ = ancestors.shape
    own = torch.eye(frontier, dtype=torch.bool, device=ancestors.device).expand(batch, -1, -1)
    return torch.cat([committed[:, None].expand(-1, frontier, -1), ancestors, own], 2)[:, None]


def grow(
    rows,
    first: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
    vocab: torch.Tensor,
    *,
    levels: int,
    top_k: int,
    keep: int | None = None,
) -> tuple[Pool, int]:
    """Expand the tree from t's row ``first = (logits [B, 1, S], hidden [B, 1, H])`` (t at ``positions
    [B]``; ``vocab [S]``: the target ids of the head's columns) for ``levels`` levels on ``rows`` (a
    ``HeadRows``; its tree rows are left for the caller to crop) -> (the pool of offered nodes, head passes
    run). ``keep``: the most nodes the caller takes (``Pool.best``; default ``levels``, the draft length that
    bounds the node budget): a level none of whose nodes could be among them is not expanded
    (``Pool.settled``), so the nodes taken are those of the full tree with fewer head passes."""
    keep = levels if keep is None else keep
    logits, hidden = first
    base, pool = len(rows), Pool()
    top = torch.log_softmax(logits[:, -1].float(), -1).topk(top_k, -1)  # [B, k]
    batch, device = logits.shape[0], logits.device
    frontier = pool.offer(top.indices, top.values, torch.full_like(top.indices, -1)).expand(batch, -1)
    tokens, scores, parent_hidden = top.indices, top.values, hidden.expand(-1, top_k, -1)
    ancestors = torch.zeros(batch, top_k, 0, dtype=torch.bool, device=device)
    committed = rows.cache.key_valid[:, :base]
    passes = 0
    for depth in range(1, levels):
        if pool.settled(scores, keep):
            break
        mask = tree_keys(committed, ancestors)
        on = torch.ones_like(tokens, dtype=torch.bool)
        at = (positions[:, None] + depth).expand_as(tokens)
        logits, out = rows.add(vocab[tokens], parent_hidden, at, on, mask=mask)
        passes += 1
        mine = torch.cat([ancestors, mask[:, 0, :, -tokens.shape[1] :]], 2)  # [B, F, R + F] with own rows
        child = torch.log_softmax(logits.float(), -1).topk(top_k, -1)  # [B, F, k]
        offered = (scores[:, :, None] + child.values).flatten(1)  # [B, F*k]
        parent = frontier[:, :, None].expand(-1, -1, top_k).flatten(1)
        index = pool.offer(child.indices.flatten(1), offered, parent)
        best = offered.topk(min(top_k, offered.shape[1]), -1).indices  # [B, k']: the next frontier
        source = best // top_k  # their parents' frontier slots
        tokens = child.indices.flatten(1).gather(1, best)
        scores, frontier = offered.gather(1, best), index[best]
        parent_hidden = out.gather(1, source[:, :, None].expand(-1, -1, out.shape[-1]))
        ancestors = mine.gather(1, source[:, :, None].expand(-1, -1, mine.shape[-1]))
    return pool, passes


def node_budget(scores: torch.Tensor, live: torch.Tensor, costs: CostModel, limit: int) -> int:
    """The batch's node budget: ``scores [B, P]`` log path probabilities of each row's pool, ``live [B]``
    bool rows still decoding -> the N (<= ``limit``) of the most expected tokens per verification cost."""
    best = scores[live].topk(min(limit, scores.shape[1]), -1).values.exp()
    return best_node_budget(costs, best.tolist(), int(live.sum()))
