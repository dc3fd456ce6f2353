"""Jacobi iteration: fixed points equal greedy autoregressive output, states equal the reference (no-cache)
iteration, batches with ragged progress equal rows alone, and the ``jacobi`` decoder equals ``autoregressive``."""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import pytest
import torch

from cllm_train.throughput import reference_trajectories
from cllm_train.trajectories import Prompt
from fastdecode.config import ConfigError
from fastdecode.decoding.common import prefill
from fastdecode.decoding.config import DecodeConfig
from fastdecode.jacobi import (
    JacobiOptions,
    JacobiSolver,
    count_stationary,
    first_mismatch,
    initial_guess,
    row_generator,
    solve_block,
)
from fastdecode.registry import DECODERS
from fastdecode.runtime.model import EarlyExitModel
from tests.conftest import ENGINES, REFERENCE, TINY_MODELS
from tests.helpers import lively_model, random_prompts, redraw_matrices, tiny_model

autoregressive, jacobi = DECODERS["autoregressive"], DECODERS["jacobi"]


@functools.cache
def _sticky(name: str) -> EarlyExitModel:
    """Weights of std 0.12: outputs that often repeat, so Jacobi fixes several tokens in one forward for some
    rows and one for others (ragged progress, holes in the cache)."""
    model = copy.deepcopy(tiny_model(name)[0])
    redraw_matrices(model, 0.12, seed=0)
    return EarlyExitModel(model)


def _models(name: str) -> list[EarlyExitModel]:
    return [_sticky(name), lively_model(name)]


def _solve(m: EarlyExitModel, prompts: list[list[int]], n: int, init: str, keys: list[str] | None = None):
    """One block per row; row i's guess is drawn with key ``f"{keys[i]}:0"`` (the collector's scheme)."""
    keys = keys or [str(i) for i in range(len(prompts))]
    state = prefill(m, prompts, 64)
    firsts = state.logits.argmax(-1).tolist()
    guesses = [
        initial_guess(init, n, p, m.vocab_size, row_generator(0, f"{key}:0"))
        for p, key in zip(prompts, keys, strict=True)
    ]
    return guesses, solve_block(m, state.cache, state.positions, firsts, guesses)


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("init", ["prompt", "vocab"])
def test_fixed_point_is_the_greedy_continuation_and_states_follow_the_reference(name, init):
    n = 6
    for m in _models(name):
        prompts = random_prompts(4, seed=11)
        guesses, blocks = _solve(m, prompts, n, init)
        ar = autoregressive(m, prompts, DecodeConfig(max_new_tokens=n + 1)).tokens
        for row, (prompt, guess, block, greedy) in enumerate(zip(prompts, guesses, blocks, ar, strict=True)):
            assert block.fixed_point == greedy[:n] and block.bonus == greedy[n]
            assert block.states[0] == guess and sum(block.committed) == n
            mismatch = [first_mismatch(s, block.fixed_point) for s in block.states]
            assert all(
                b > a for a, b in zip(mismatch, mismatch[1:], strict=False)
            )  # >= 1 more token fixed per iteration
            # The reference iteration (batch 1, no cache, prompt + block re-encoded) passes the same states.
            ref = reference_trajectories(m.hf, Prompt(str(row), prompt), n, init, n, eos_ids=set(), seed=0)
            assert [r["states"] for r in ref] == [block.states]


def test_ragged_progress_leaves_holes_and_rows_match_alone():
    m, n = _sticky("tiny-llama"), 8
    prompts = random_prompts(5, seed=2)
    _, blocks = _solve(m, prompts, n, "prompt")
    committed = [tuple(b.committed) for b in blocks]
    assert len(set(committed)) > 1 and max(max(c) for c in committed) > 1  # rows really progress raggedly
    for row, prompt in enumerate(prompts):
        alone = _solve(m, [prompt], n, "prompt", keys=[str(row)])[1][0]
        assert alone.states == blocks[row].states and alone.bonus == blocks[row].bonus


def test_solver_keeps_exactly_the_block_in_the_cache():
    """After a block converges the cache holds prefix + fixed point: a second block continues the greedy run."""
    m, n = lively_model("tiny-llama"), 5
    prompts = random_prompts(3, seed=4)
    state = prefill(m, prompts, 64)
    solver = JacobiSolver(m, state.cache, state.positions, n)
    firsts = state.logits.argmax(-1).tolist()
    out: dict[int, list[int]] = {row: [] for row in range(3)}
    for row, first in enumerate(firsts):
        solver.begin(row, [first] * n, first)
    while solver.open_rows:
        for block in solver.step():
            out[block.row] += block.fixed_point
            if len(out[block.row]) < 2 * n:
                solver.begin(block.row, [block.bonus] * n, block.bonus)
    ar = autoregressive(m, prompts, DecodeConfig(max_new_tokens=2 * n)).tokens
    assert [out[row] for row in range(3)] == ar
    assert solver.tokens_run >= 2 * n * 3


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("batch", [1, 3])
def test_jacobi_decoder_equals_autoregressive(name, batch, engine):
    for m in _models(name):
        for seed, (init, eos) in enumerate(
            [("repeat", None), ("prompt", 92), ("vocab", m.config.eos_token_id)]
        ):
            prompts = random_prompts(batch, seed=20 + seed)
            cfg = DecodeConfig(max_new_tokens=23, jacobi=JacobiOptions(block=5, init=init), eos_token_id=eos)
            ar = autoregressive(m, prompts, replace(cfg, **REFERENCE))
            cfg = replace(cfg, **ENGINES[engine])
            out = jacobi(m, prompts, cfg)
            assert out.tokens == ar.tokens
            assert out.steps <= ar.steps + 1 and all(f >= 1 for f in out.fast_forward)
            # every forward fixes >= 1 token per row: at most one forward per emitted token (+ the last block)
            assert sum(out.fast_forward) <= out.num_tokens + batch * cfg.jacobi.block


@pytest.mark.parametrize("n", [2, 7, 16])
def test_jacobi_decoder_equals_autoregressive_on_many_prompts(n):
    for m in _models("tiny-llama"):
        prompts = random_prompts(12, seed=n)
        cfg = DecodeConfig(max_new_tokens=19, jacobi=JacobiOptions(block=n, init="prompt"), seed=n)
        expected = autoregressive(m, prompts, cfg).tokens
        assert [t for i in range(0, 12, 3) for t in jacobi(m, prompts[i : i + 3], cfg).tokens] == expected


def test_jacobi_decoder_stops_at_eos_inside_a_block():
    m = _sticky("tiny-llama")
    prompts = random_prompts(3, seed=5)
    greedy = autoregressive(m, prompts, DecodeConfig(max_new_tokens=20)).tokens
    eos = greedy[0][3]  # a token the first row emits early, inside its first block
    cfg = DecodeConfig(max_new_tokens=20, jacobi=JacobiOptions(block=8), eos_token_id=eos)
    out = jacobi(m, prompts, cfg)
    assert out.tokens == autoregressive(m, prompts, cfg).tokens
    assert out.tokens[0][-1] == eos and len(out.tokens[0]) <= 4


def test_stationary_and_first_mismatch():
    states = [[9, 2, 3, 9], [1, 9, 3, 9], [1, 2, 3, 4]]
    assert [first_mismatch(s, states[-1]) for s in states] == [0, 1, 4]
    # position 2 holds its final token from y(0) on while position 0 is wrong: stationary; 3 is not (changes).
    assert count_stationary(states) == 1


def test_bad_input_fails_clearly():
    with pytest.raises(ConfigError, match=r"decoder.jacobi.block=1: a Jacobi block needs n >= 2"):
        DecodeConfig(max_new_tokens=4, jacobi=JacobiOptions(block=1))
    with pytest.raises(ConfigError, match=r"Jacobi initial guess 'zeros'.*\(decoder.jacobi.init\)"):
        DecodeConfig(max_new_tokens=4, jacobi=JacobiOptions(init="zeros"))
    m = lively_model("tiny-llama")
    with pytest.raises(ConfigError, match="temperature=0"):
        jacobi(m, [[5, 6]], DecodeConfig(max_new_tokens=4, temperature=0.7))
    with pytest.raises(ConfigError, match="n >= 2"):
        JacobiSolver(m, m.new_cache(1, 8), torch.tensor([1]), 1)
