"""Greedy Jacobi decoding (the CLLM decoder): refine a block of ``decoder.jacobi.block`` tokens in parallel
until it reaches its fixed point, which equals greedy autoregressive output.

The iteration itself is ``fastdecode/jacobi.py``. This module owns the decoder: its checks, each row's
initial guess (``decoder.jacobi.init``), the early finish of a row whose verified tokens already hold an EOS
or fill its budget, and what it counts (``steps``, ``fast_forward``, ``stationary``). Design notes:
docs/design/decoding.md.
"""

from __future__ import annotations

import torch

from fastdecode.config import ConfigError
from fastdecode.decoding.common import Rows, check, configure_engine, prefill, refuse_draft_model
from fastdecode.decoding.config import DecodeConfig, DecodeOutput
from fastdecode.jacobi import JacobiSolver, count_stationary, initial_guess, row_generator
from fastdecode.runtime.model import EarlyExitModel


def _refuse(cfg: DecodeConfig) -> None:
    if not cfg.greedy:
        raise ConfigError(
            "decoder 'jacobi' is greedy (its fixed point is the greedy output): set decoder.temperature=0."
        )
    if cfg.exit_layer is not None:
        raise ConfigError("decoder 'jacobi' runs the full model: set decoder.exit_layer=null.")


class _Rows(Rows):
    """``Rows`` plus what a Jacobi decoder needs per row: the prompt (for ``prompt`` guesses), a generator."""

    def __init__(self, prompts: list[list[int]], cfg: DecodeConfig, vocab_size: int) -> None:
        super().__init__(len(prompts), cfg)
        self.prompts, self.cfg, self.vocab_size = prompts, cfg, vocab_size
        self.generators = [row_generator(cfg.seed, f"jacobi:{row}") for row in range(len(prompts))]

    def guess(self, row: int, nxt: int) -> list[int]:
        context = self.prompts[row] + self.tokens[row]
        strategy, n = self.cfg.jacobi.init, self.cfg.jacobi.block
        return initial_guess(strategy, n, context, self.vocab_size, self.generators[row], lead=nxt)


def _settle(solver: JacobiSolver, rows: _Rows, row: int, out: DecodeOutput) -> None:
    """Finish ``row`` early when its verified tokens already contain EOS or fill the budget."""
    verified = solver.verified(row)
    budget_left = rows.budget - len(rows.tokens[row])
    if len(verified) >= budget_left or any(t in rows.eos for t in verified):
        out.fast_forward += solver.blocks[row].committed
        rows.emit(row, verified)
        solver.close(row)


@torch.inference_mode()
def generate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """Jacobi-decode ``prompts`` (batch of token-id lists); output equals ``autoregressive`` (greedy)."""
    check(cfg, m, prompts)
    refuse_draft_model("jacobi", draft)
    _refuse(cfg)
    configure_engine(m, cfg)  # the execution engine this call decodes on (the checks above change nothing)
    n = cfg.jacobi.block
    width = max(len(p) for p in prompts)
    state = prefill(m, prompts, width + cfg.max_new_tokens + 2 * n)
    solver = JacobiSolver(m, state.cache, state.positions, n)
    rows = _Rows(prompts, cfg, m.vocab_size)
    out = DecodeOutput(tokens=rows.tokens)
    for row, first in enumerate(state.logits.argmax(-1).tolist()):
        solver.begin(row, rows.guess(row, first), first)
        _settle(solver, rows, row, out)
    while solver.open_rows:
        tokens_in = solver.tokens_run
        for block in solver.step():
            row = block.row
            out.fast_forward += block.committed
            out.stationary.append(count_stationary(block.states))
            rows.emit(row, block.fixed_point)
            if not rows.finished[row]:
                solver.begin(row, rows.guess(row, block.bonus), block.bonus)
        for row in solver.open_rows:
            _settle(solver, rows, row, out)
        out.steps += 1
        out.layers_run += (solver.tokens_run - tokens_in) * m.num_layers
        out.layer_calls += m.num_layers
    return out
