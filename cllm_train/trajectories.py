"""Solve the Jacobi trajectories of a batch of prompts: block after block, until EOS or ``max_new_seq_len``.

One batch shares one KV cache (``fastdecode.decoding.common.prefill``); every row runs its own blocks through
``fastdecode.jacobi.JacobiSolver``, and a finished row stops taking part. Initial guesses depend only on
``(seed, prompt id, block)``. Repetition filters (``FilterConfig``) drop the block that trips one and stop
the prompt there. Why: docs/design/methods.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from fastdecode.decoding.common import prefill
from fastdecode.jacobi import Block, JacobiSolver, first_mismatch, initial_guess, row_generator
from fastdecode.runtime.model import EarlyExitModel


@dataclass
class FilterConfig:
    """``max_repeat_run``: drop a block once the output holds this many identical consecutive tokens;
    ``ngram_size``/``max_ngram_repeats``: once an n-gram occurs more than this often. null disables each."""

    max_repeat_run: int | None = 10
    ngram_size: int | None = 8
    max_ngram_repeats: int = 3


@dataclass
class Prompt:
    """One prompt to collect: its id, chat-templated ids, and the reference reply ids (or None)."""

    id: str
    ids: list[int]
    labels: list[int] | None = None


@dataclass
class ChunkResult:
    """Records per prompt (in prompt order), prompts stopped per filter, model forwards and tokens fixed."""

    records: list[list[dict]]
    filtered: Counter = field(default_factory=Counter)
    forwards: int = 0
    tokens: int = 0  # fixed-point tokens of the kept records


def repetition(tokens: list[int], cfg: FilterConfig) -> str | None:
    """The filter ``tokens`` trips (``repeat_run`` / ``repeat_ngram``), or None."""
    if cfg.max_repeat_run is not None:
        run = 0
        for i, token in enumerate(tokens):
            run = run + 1 if i and token == tokens[i - 1] else 1
            if run >= cfg.max_repeat_run:
                return "repeat_run"
    if cfg.ngram_size is not None and len(tokens) >= cfg.ngram_size:
        size = cfg.ngram_size
        counts = Counter(tuple(tokens[i : i + size]) for i in range(len(tokens) - size + 1))
        if max(counts.values()) > cfg.max_ngram_repeats:
            return "repeat_ngram"
    return None


def make_record(prompt: Prompt, index: int, prefix: list[int], block: Block, eos_ids: set[int]) -> dict:
    """The schema record (``cllm_train/records.py``) of block ``index`` of ``prompt``."""
    fixed = block.fixed_point
    return {
        "prompt_id": prompt.id,
        "block": index,
        "prefix": list(prefix),
        "states": [list(s) for s in block.states],
        "first_mismatch": [first_mismatch(s, fixed) for s in block.states],
        "fixed_point": list(fixed),
        "eos": any(t in eos_ids for t in fixed),
        "labels": prompt.labels,
        "prompt_len": len(prompt.ids),
    }


@dataclass
class _Row:
    prompt: Prompt
    output: list[int] = field(default_factory=list)  # converged tokens so far
    records: list[dict] = field(default_factory=list)


@torch.inference_mode()
def collect_chunk(
    m: EarlyExitModel,
    prompts: list[Prompt],
    *,
    n: int,
    init: str,
    max_new_seq_len: int,
    eos_ids: set[int],
    filters: FilterConfig,
    seed: int,
) -> ChunkResult:
    """Trajectories of ``prompts`` (one batch): every block from the prompt to EOS or ``max_new_seq_len``."""
    rows = [_Row(p) for p in prompts]
    width = max(len(p.ids) for p in prompts)
    blocks_per_prompt = -(-max_new_seq_len // n)
    # Room for every block without holes; the cache grows (doubling) if ragged rows leave many.
    state = prefill(m, [p.ids for p in prompts], width + n * (blocks_per_prompt + 1))
    solver = JacobiSolver(m, state.cache, state.positions, n)
    result = ChunkResult([row.records for row in rows])

    def begin(index: int, nxt: int) -> None:
        row = rows[index]
        prefix = row.prompt.ids + row.output
        generator = row_generator(seed, f"{row.prompt.id}:{len(row.records)}")
        solver.begin(index, initial_guess(init, n, prefix, m.vocab_size, generator), nxt)

    for index, first in enumerate(state.logits.argmax(-1).tolist()):
        begin(index, first)
    while solver.open_rows:
        for block in solver.step():
            row = rows[block.row]
            record = make_record(row.prompt, len(row.records), row.prompt.ids + row.output, block, eos_ids)
            row.output += block.fixed_point
            cut = next((i + 1 for i, t in enumerate(row.output) if t in eos_ids), len(row.output))
            reason = repetition(row.output[:cut], filters)
            if reason is not None:
                result.filtered[reason] += 1
                continue
            row.records.append(record)
            result.tokens += n
            if not record["eos"] and len(row.output) < max_new_seq_len:
                begin(block.row, block.bonus)
    result.forwards = solver.forwards
    return result
