"""The cost model (fastdecode/cost.py) and the choices made with it (fastdecode/choose.py): one definition
of a block, verification costs per number of new tokens, expected speedups, exits and plans that pay."""

from __future__ import annotations

import json

import pytest
import torch

from fastdecode.choose import MIN_SPEEDUP, RecordedAdapter, choose_exit, plan_decoding, recorded_adapter
from fastdecode.config import ConfigError
from fastdecode.cost import (
    CostModel,
    best_draft_length,
    block_parameters,
    cost_model,
    decoding_costs,
    estimate_costs,
    exit_draft_cost,
    expected_tokens,
    monotone,
)
from fastdecode.exit_adapter import INDEX_FILE, build_adapter, save_adapter
from tests.helpers import lively_model

# A CPU-like cost model of a 30-layer model (verification over T = 2 / 3 / 4 tokens costs 1.13 / 1.21 / 1.60
# plain steps, the step at T = 4 that the proposers issue measured) and its GPU-like twin (memory-bound: a
# forward costs the same for every small T).
CPU = CostModel(30, 1000, (1, 2, 3, 4), (0.03, 0.034, 0.0363, 0.048), (0.1, 0.11, 0.121, 0.16), "measured")
GPU = CostModel(30, 1000, (1,), (0.03,), (0.1,), "estimated")


def test_costs_are_in_plain_steps_and_interpolated():
    for costs in (CPU, GPU):
        assert costs.verify(1) == pytest.approx(1.0)  # a round without drafts is one plain step
        assert costs.round_cost(0, 0.5, depth=7) == pytest.approx(1.0)
    assert [round(CPU.verify(t), 2) for t in (2, 3, 4)] == [1.13, 1.21, 1.6]
    assert CPU.verify(6) > CPU.verify(4)  # extrapolated from the last two probes
    assert GPU.verify(9) == pytest.approx(1.0)
    # Self-speculation verifies from depth E: the last draft's pass through E blocks, then the rest over T.
    assert CPU.verify(3, depth=10) == pytest.approx(10 * 0.03 + 20 * 0.0363 + 0.121)
    # A drafted token: E blocks, a head of S rows, an adapter's blocks.
    assert CPU.draft_token(10) == pytest.approx(0.3 + 0.1)
    assert CPU.draft_token(10, head_rows=250, extra_blocks=1.0) == pytest.approx(0.33 + 0.025)
    assert CPU.to_json()["source"] == "measured"


def test_expected_tokens_and_the_best_draft_length_see_the_verification_step():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1.75)
    assert expected_tokens([1.0] * 4) == 5.0
    # Free drafts (n-gram) accepted half the time: on the GPU model longer drafts keep paying, on the CPU
    # model the step at T = 4 makes 2 drafts the best.
    k_gpu, s_gpu = best_draft_length(GPU, [0.5] * 6, 0.0)
    k_cpu, s_cpu = best_draft_length(CPU, [0.5] * 6, 0.0)
    assert k_gpu == 6 and s_gpu == pytest.approx(expected_tokens([0.5] * 6))
    assert k_cpu == 2 and s_cpu == pytest.approx(1.75 / 1.21)
    assert best_draft_length(CPU, [0.05] * 6, 0.0) == (
        0,
        pytest.approx(1.0),
    )  # drafts that rarely land: a plain step


def test_choose_exit_counts_the_head_the_drafter_and_the_verification():
    # A perfect shallow exit beats a mediocre deep one; useless exits give "no speculation".
    assert choose_exit({4: 0.95, 24: 0.5}, GPU)["exit"] == 4
    assert choose_exit({4: 0.0, 16: 0.0}, GPU)["exit"] is None
    assert choose_exit({1: 0.04}, GPU)["exit"] is None  # a small expected gain is noise, not a recommendation
    # The same acceptance pays on the memory-bound model and not on the CPU one, where verifying costs more.
    assert choose_exit({4: 0.35}, GPU)["exit"] == 4
    cpu = choose_exit({4: 0.35}, CPU)
    assert cpu["exit"] is None and cpu["best_found"]["exit"] == 4 and cpu["costs"] == "measured"
    assert cpu["best_found"]["expected_speedup"] < MIN_SPEEDUP
    # A costly drafter (an adapter's block and the full head) lowers what an exit is worth.
    cheap = choose_exit({4: 0.6}, GPU)["expected_speedup"]
    costly = choose_exit({4: 0.6}, GPU, draft_costs={4: GPU.draft_token(4, extra_blocks=10.0)})
    assert costly["expected_speedup"] < cheap


def test_one_definition_of_a_block_and_the_estimate(tiny_llama):
    m = lively_model("tiny-llama")
    block = sum(p.numel() for layer in m.layers for p in layer.parameters()) / m.num_layers
    assert block_parameters(m) == block
    est = estimate_costs(m)
    step = 4 * block + m.lm_head.weight.numel()
    assert est.source == "estimated" and est.layer[0] == pytest.approx(block / step)
    assert est.verify(5) == pytest.approx(1.0) and est.head_cost() == pytest.approx(
        m.lm_head.weight.numel() / step
    )
    adapter = build_adapter(m, 2)
    with_adapter = exit_draft_cost(est, m, 2, adapter=adapter, vocab=torch.arange(50))
    assert with_adapter == pytest.approx(
        est.draft_token(2, head_rows=50, extra_blocks=adapter.num_parameters() / block)
    )
    assert exit_draft_cost(est, m, 2, vocab=torch.arange(50)) == pytest.approx(
        est.draft_token(2, head_rows=50)
    )


def test_measured_costs_are_timed_once_per_model_engine_and_threads():
    m = lively_model("tiny-llama")
    costs = decoding_costs(m)
    assert costs.source == "measured" and costs.step_seconds > 0
    assert costs.verify(1) == pytest.approx(1.0) and all(x > 0 for x in costs.layer + costs.head)
    assert cost_model(m) is costs  # kept on the model for this engine and thread count
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert cost_model(m) is not costs
    finally:
        torch.set_num_threads(threads)
    assert cost_model(m, "estimated").source == "estimated"
    # An adapter's drafted token is timed on the model (its attention, cache layer and call), once.
    adapter = build_adapter(m, 2).eval()
    timed = exit_draft_cost(costs, m, 2, adapter=adapter)
    assert 0 < timed < 2 and exit_draft_cost(costs, m, 2, adapter=adapter) == timed
    with pytest.raises(ConfigError, match="Unknown cost model source 'guessed'"):
        cost_model(m, "guessed")


def test_the_plan_chains_a_paying_exit_and_otherwise_looks_up(tmp_path):
    m = lively_model("tiny-llama")
    plain = plan_decoding(m, GPU)
    assert [c.method for c in plain.candidates] == ["prompt_lookup"] and plain.not_paying == []
    assert plain.best.options["policy"] == "adaptive"
    paying = plan_decoding(m, GPU, exit_agreement={1: 0.1, 2: 0.95, 3: 0.99})
    assert paying.best.method == "self_speculative" and paying.best.options["chain"] is True
    assert paying.best.options["exit_layer"] in (2, 3) and paying.best.expected_speedup > MIN_SPEEDUP
    assert paying.candidates[-1].name == "prompt_lookup"
    poor = plan_decoding(m, CPU, exit_agreement={2: 0.2})
    assert [c.name for c in poor.candidates] == ["prompt_lookup"]
    assert poor.not_paying[0]["drafter"] == "exit" and poor.not_paying[0]["expected_speedup"] < 1
    unknown = RecordedAdapter("somewhere", 2, 1000, None, None)
    assert plan_decoding(m, GPU, adapter=unknown).not_paying[0]["reason"] == "no acceptance recorded"


def test_a_recorded_adapter_is_read_without_loading_it(tmp_path):
    m = lively_model("tiny-llama")
    adapter = build_adapter(m, 2)
    save_adapter(adapter, tmp_path / "E2", m, vocab=torch.arange(40))
    (tmp_path / INDEX_FILE).write_text(
        json.dumps({"adapters": {"2": "E2"}, "chosen": 2, "agreement": {"adapter": {"2": 0.7}}})
    )
    found = recorded_adapter(str(tmp_path))
    assert found == RecordedAdapter(str(tmp_path / "E2"), 2, adapter.num_parameters(), 40, 0.7)
    plan = plan_decoding(m, GPU, adapter=found)
    assert plan.best.options["adapter"] == str(tmp_path / "E2") and plan.best.options["chain"]


def test_measured_costs_never_fall_with_more_tokens():
    """The times a loaded machine disturbed (as the B run of issue 19 recorded: one layer over 2 tokens timed
    at 0.83x of one token) are raised to the running maximum, so no verification looks cheaper than a step."""
    assert monotone([0.030, 0.025, 0.032, 0.029, 0.033]) == [0.030, 0.030, 0.032, 0.032, 0.033]
    assert monotone([]) == [] and monotone([1.0]) == [1.0]
