"""Greedy Jacobi iteration over the explicit KV cache: the one core behind trajectory collection (CLLM
training data) and the ``jacobi`` decoder.

It owns ``JacobiSolver`` (batched rows refined block by block, rejected slots rolled back by the cache's
length pointer), ``solve_block``, the seeded initial guesses and the counts CLLM reports. The iteration and
why batched rows equal rows decoded alone: docs/design/core.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.model import EarlyExitModel

INITS = ("prompt", "vocab", "repeat")  # initial guess: tokens of the current prefix | any token | nxt x n


def check_block_size(n: int, where: str = "block_size") -> None:
    if not isinstance(n, int) or n < 2:
        raise ConfigError(f"{where}={n}: a Jacobi block needs n >= 2 tokens (the reference uses 16 or 32).")


def check_init(strategy: str, where: str = "init") -> None:
    if strategy not in INITS:
        raise unknown_name_error("Jacobi initial guess", strategy, list(INITS), f"({where})")


@dataclass
class JacobiOptions:
    """``decoder.jacobi``: the ``jacobi`` decoder. ``block``: the n >= 2 tokens refined in parallel;
    ``init``: the initial guess, ``repeat`` | ``prompt`` | ``vocab``."""

    block: int = 16
    init: str = "repeat"

    def __post_init__(self) -> None:
        check_block_size(self.block, "decoder.jacobi.block")
        check_init(self.init, "decoder.jacobi.init")


def row_generator(seed: int, key: str) -> torch.Generator:
    """A CPU generator seeded from ``(seed, key)``: draws that do not depend on batching, order or rank."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def initial_guess(
    strategy: str,
    n: int,
    prefix: list[int],
    vocab_size: int,
    generator: torch.Generator,
    *,
    lead: int | None = None,
) -> list[int]:
    """``y(0)``, ``n`` tokens: uniform over ``prefix`` tokens (``prompt``, as the CLLM reference), over the
    vocabulary (``vocab``), or ``lead`` repeated (``repeat``). ``lead`` (the known next token) replaces
    ``y(0)[0]`` when given: the decoder uses it, collection keeps the reference's fully random guess."""
    check_init(strategy)
    if strategy == "prompt":
        picks = torch.randint(len(prefix), (n,), generator=generator).tolist()
        guess = [prefix[i] for i in picks]
    elif strategy == "vocab":
        guess = torch.randint(vocab_size, (n,), generator=generator).tolist()
    else:
        if lead is None:
            raise ConfigError("init 'repeat' repeats the known next token: pass lead=<token id>.")
        guess = [lead] * n
    if lead is not None:
        guess[0] = lead
    return guess


def first_mismatch(state: list[int], fixed_point: list[int]) -> int:
    """Index of the first position where ``state`` differs from ``fixed_point`` (its length if none)."""
    for i, (a, b) in enumerate(zip(state, fixed_point, strict=True)):
        if a != b:
            return i
    return len(fixed_point)


def count_stationary(states: list[list[int]]) -> int:
    """Positions that reached their fixed-point token and kept it while an earlier position was still wrong.

    ``states``: ``y(0) .. y*``. Position i counts when, in the first state from which it never changes again,
    the first mismatch with ``y*`` lies before i (the CLLM paper's "stationary tokens").
    """
    fixed = states[-1]
    mismatch = [first_mismatch(s, fixed) for s in states]
    count = 0
    for i, token in enumerate(fixed):
        settled = len(states) - 1
        while settled > 0 and states[settled - 1][i] == token:
            settled -= 1
        count += int(mismatch[settled] < i)
    return count


@dataclass
class Block:
    """A solved block of one row: ``states`` = ``y(0) .. y*`` (``y*`` once), ``committed`` = the fast-forward
    count of each iteration, ``bonus`` = the greedy token after the block."""

    row: int
    states: list[list[int]]
    committed: list[int]
    bonus: int

    @property
    def fixed_point(self) -> list[int]:
        return self.states[-1]

    @property
    def forwards(self) -> int:
        return len(self.committed)


@dataclass
class _Open:
    state: list[int]
    nxt: int
    states: list[list[int]]
    committed: list[int] = field(default_factory=list)
    done: int = 0  # c: block tokens whose KV is cached


class JacobiSolver:
    """Batched greedy Jacobi iteration for rows whose prefixes are in ``cache`` (slots valid per row).

    Rows keep the ids they had in the cache when the solver was made. A row that has no open block when
    ``step`` runs is retired: its cache row is dropped (``KVCache.select_rows``), so finished rows cost
    nothing, and ``begin`` on it raises. Open the next block right after its predecessor converged.

    Args:
        m: the model (all layers run).
        cache: holds each row's prefix; the solver appends block tokens and rolls back rejected ones.
        positions: ``[B]`` position of each row's next token (its prefix length).
        n: block size.
    """

    def __init__(self, m: EarlyExitModel, cache: KVCache, positions: torch.Tensor, n: int) -> None:
        check_block_size(n)
        self.m, self.cache, self.n = m, cache, n
        self.slots = list(range(cache.batch_size))  # cache row -> row id
        self.positions = dict(enumerate(positions.tolist()))  # row id -> position of its block's token 0
        self.blocks: dict[int, _Open | None] = dict.fromkeys(self.slots)
        self.forwards = 0
        self.tokens_run = 0  # block tokens fed through the model (padding excluded)
        self.max_position = m.config.max_position_embeddings - 1

    def begin(self, row: int, guess: list[int], nxt: int) -> None:
        """Open a block at ``row``'s next position: initial guess ``y(0)`` and the known next token."""
        if len(guess) != self.n:
            raise ValueError(f"guess has {len(guess)} tokens, the block size is {self.n}")
        if row not in self.slots or self.blocks[row] is not None:
            raise ValueError(f"row {row} is retired or already has an open block")
        self.blocks[row] = _Open(list(guess), nxt, [list(guess)])

    def close(self, row: int) -> None:
        """Abandon ``row``'s open block (a decoder that stops early)."""
        self.blocks[row] = None

    @property
    def open_rows(self) -> list[int]:
        return [row for row in self.slots if self.blocks[row] is not None]

    def verified(self, row: int) -> list[int]:
        """The leading tokens of ``row``'s current state known to be on the fixed point."""
        block = self.blocks[row]
        return block.state[: block.done] + [block.nxt]

    def _retire(self, rows: list[int]) -> None:
        if len(rows) < len(self.slots):
            keep = [i for i, row in enumerate(self.slots) if self.blocks[row] is not None]
            self.cache.select_rows(torch.tensor(keep, device=self.cache.key_valid.device))
            self.slots = [self.slots[i] for i in keep]

    def step(self) -> list[Block]:
        """One forward over every open block; returns the blocks that converged (and closes them)."""
        rows = self.open_rows
        if not rows:
            raise ValueError("no open block: call begin() first")
        self._retire(rows)
        n, blocks = self.n, [self.blocks[row] for row in rows]
        width = max(n - block.done for block in blocks)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        first = torch.tensor(
            [self.positions[row] + block.done for row, block in zip(rows, blocks, strict=True)]
        )
        pos = (first[:, None] + torch.arange(width)).clamp(max=self.max_position)  # [B, W]
        for i, block in enumerate(blocks):
            ids[i, : n - block.done] = torch.tensor(block.state[block.done :])
            valid[i, : n - block.done] = True  # padding after a row's block: slots no one attends to
            self.tokens_run += n - block.done
        ids, valid, pos = (t.to(self.m.device) for t in (ids, valid, pos))
        start = self.cache.lengths[0]
        self.cache.reserve(valid, start, pos)
        hidden = self.m.run_layers(self.m.embed(ids, pos), 0, self.m.num_layers, pos, cache=self.cache)
        pred = self.m.exit_logits(hidden).argmax(-1).tolist()  # the one host sync per iteration
        self.forwards += 1
        kept, finished = [], []
        for i, row in enumerate(rows):
            j, converged = self._advance(row, pred[i])
            kept.append(j)
            if converged is not None:
                finished.append(converged)
        longest = max(kept)
        self.cache.crop(start + longest)
        kept_t = torch.tensor(kept, device=self.m.device)
        keep = torch.arange(longest, device=self.m.device)[None, :] < kept_t[:, None]  # [B, longest]
        self.cache.key_valid[:, start : start + longest] &= keep  # rows that kept fewer: holes
        return finished

    def _advance(self, row: int, pred: list[int]) -> tuple[int, Block | None]:
        """Apply one iteration's predictions to ``row``: returns (KV slots kept, the Block if converged)."""
        block, n = self.blocks[row], self.n
        c = block.done
        new = block.state[:c] + [block.nxt] + pred[: n - c - 1]
        j = 0
        while c + j < n and new[c + j] == block.state[c + j]:
            j += 1
        block.committed.append(j)
        if c + j == n:  # y' == y: the fixed point, all of it cached now
            self.blocks[row] = None
            self.positions[row] += n
            return j, Block(row, block.states, block.committed, pred[n - c - 1])
        block.state, block.done = new, c + j
        block.nxt = new[c + j]
        block.states.append(new)
        return j, None


def solve_block(
    m: EarlyExitModel,
    cache: KVCache,
    positions: torch.Tensor,
    firsts: list[int],
    guesses: list[list[int]],
) -> list[Block]:
    """Solve one block for every row to its fixed point; returns the Blocks in row order.

    ``firsts[b]`` is the greedy token after row b's prefix (argmax of its last prefix logits), ``guesses[b]``
    its ``y(0)``. Rows that converge before others are retired from the cache (see ``JacobiSolver``).
    """
    solver = JacobiSolver(m, cache, positions, len(guesses[0]))
    for row, (guess, first) in enumerate(zip(guesses, firsts, strict=True)):
        solver.begin(row, guess, first)
    done: dict[int, Block] = {}
    while solver.open_rows:
        for block in solver.step():
            done[block.row] = block
    return [done[row] for row in range(len(guesses))]
