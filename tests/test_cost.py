"""The cost model (fastdecode/plan/cost.py) and the choices made with it (fastdecode/plan/choose.py): one definition
of a block, verification costs per number of new tokens, expected speedups, exits and plans that pay."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

import fastdecode.plan.cost as cost
import fastdecode.registry  # noqa: F401  (fills the loop's tables that plan_decoding reads)
import fastdecode.runtime.identity as identity
from fastdecode.config import ConfigError
from fastdecode.drafters.eagle3.kind import HEAD_REPEATS, head_token_cost, measure_head
from fastdecode.drafters.eagle3.model import Eagle3Config, Eagle3Head
from fastdecode.drafters.exits.adapter import INDEX_FILE, build_adapter, load_adapter, save_adapter
from fastdecode.drafters.exits.record import RecordedAdapter, recorded_adapter
from fastdecode.plan.acceptance import AcceptanceRecord, DrafterRecord
from fastdecode.plan.choose import LOOKUP_PRIOR, MIN_SPEEDUP, choose_exit, plan_decoding
from fastdecode.plan.cost import (
    CostModel,
    best_draft_length,
    block_parameters,
    cost_model,
    decoding_costs,
    drafter_key,
    estimate_costs,
    exit_draft_cost,
    expected_tokens,
    lower_envelope,
    measure_costs,
    pad_lengths,
)
from fastdecode.runtime.identity import weights_fingerprint
from fastdecode.runtime.model import EarlyExitModel
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


def exits(agreement: dict[int, float]) -> AcceptanceRecord:
    """A checkpoint's record of its raw exits' acceptance (full head)."""
    return AcceptanceRecord([DrafterRecord("exit", a, e) for e, a in agreement.items()])


def test_the_plan_chains_a_paying_exit_and_otherwise_looks_up(tmp_path):
    m = lively_model("tiny-llama")
    plain = plan_decoding(m, GPU)
    assert [c.method for c in plain.candidates] == ["prompt_lookup"] and plain.not_paying == []
    assert plain.best.options["policy"] == "adaptive" and plain.best.options["exit_layer"] is None
    assert plain.best.expected_speedup == pytest.approx(LOOKUP_PRIOR.speedup(GPU))
    paying = plan_decoding(m, GPU, record=exits({1: 0.1, 2: 0.95, 3: 0.99}))
    assert paying.best.method == "self_speculative" and paying.best.options["chain"] is True
    assert paying.best.options["exit_layer"] in (2, 3) and paying.best.expected_speedup > MIN_SPEEDUP
    assert paying.best.options["draft_vocab"] is None and paying.best.options["adapter"] is None
    assert paying.candidates[-1].name == "prompt_lookup"
    poor = plan_decoding(m, CPU, record=exits({2: 0.2}))
    assert [c.name for c in poor.candidates] == ["prompt_lookup"]
    assert poor.not_paying[0]["drafter"] == "exit" and poor.not_paying[0]["expected_speedup"] < 1


def test_a_chain_is_expected_to_gain_over_lookup_alone_only_where_lookup_takes_plain_steps():
    """Chaining a drafter that is s times faster than plain decoding speeds up only the rounds where the
    lookup drafts nothing: on the prior's share of such rounds, never by s overall."""
    alone = LOOKUP_PRIOR.speedup(GPU)
    chained = LOOKUP_PRIOR.speedup(GPU, fallback=1.5)
    assert alone < chained < 1.5 * alone
    q, t = LOOKUP_PRIOR.drafted, LOOKUP_PRIOR.tokens
    time_alone = q * GPU.verify(round(LOOKUP_PRIOR.width) + 1) + (1 - q)
    assert chained == pytest.approx((q * t + 1 - q) / (time_alone - (1 - q) * (1 - 1 / 1.5)))
    assert LOOKUP_PRIOR.speedup(GPU, fallback=1.0) == pytest.approx(alone)
    # a fallback that costs something in the lookup's own rounds (an EAGLE-3 head writing its rows) pays it
    ride = LOOKUP_PRIOR.speedup(GPU, fallback=1.5, ride=0.1)
    assert ride == pytest.approx((q * t + 1 - q) / (time_alone + q * 0.1 - (1 - q) * (1 - 1 / 1.5)))


def test_a_verification_runs_as_a_larger_t_only_where_that_measured_cheaper():
    """``pad_lengths``: T=2 measured slower than T=3 and T=4 (oneDNN's two-row kernels on some CPUs) runs as
    the cheapest larger T; within the margin (noise) T stays; ``run_length`` answers per T, T itself beyond
    the probes and for models measured before pads existed."""
    tokens = (1, 2, 3, 4, 5)
    assert pad_lengths(tokens, [1.0, 1.45, 1.3, 1.15, 1.3]) == (1, 4, 4, 4, 5)
    assert pad_lengths(tokens, [1.0, 1.1, 1.05, 1.2, 1.3]) == (1, 2, 3, 4, 5)  # 5% cheaper: noise, kept
    m = lively_model("tiny-llama")
    slow_two = {1: 1.0, 2: 1.5, 4: 1.1}

    def timer(name, fn, device):
        return slow_two[name[1]] * (1.0 if name[0] == "layers" else 0.01)

    costs = measure_costs(m, (1, 2, 4), timer=timer)
    assert costs.pad == (1, 4, 4) and [costs.run_length(t) for t in (1, 2, 3, 4, 9)] == [1, 4, 3, 4, 9]
    assert costs.verify(2) == pytest.approx(costs.verify(4))  # the price of what it runs
    assert CPU.run_length(2) == 2  # no pads recorded


def test_replayed_rounds_price_an_exit_below_its_iid_acceptance():
    """Rounds start right after a rejection, where a drafter is more often wrong: a recorded replay that
    says so prices the exit lower than the per-token acceptance alone would."""
    iid = choose_exit({2: 0.6}, GPU)
    assert iid["exit"] == 2 and iid["expected_speedup"] > 1.4
    replayed = choose_exit({2: 0.6}, GPU, rounds={2: {k: 1.1 for k in range(1, 9)}})
    assert replayed["exit"] is None and replayed["best_found"]["expected_speedup"] < 1.0


def test_an_adapter_without_a_recorded_acceptance_is_not_planned(tmp_path):
    m = lively_model("tiny-llama")
    save_adapter(build_adapter(m, 2), tmp_path / "E2", m)
    plan = plan_decoding(m, GPU, adapter=str(tmp_path / "E2"))
    assert plan.not_paying[0]["reason"] == "no acceptance recorded"
    assert [c.name for c in plan.candidates] == ["prompt_lookup"]


def test_a_recorded_adapter_is_read_without_loading_it(tmp_path):
    m = lively_model("tiny-llama")
    adapter = build_adapter(m, 2)
    save_adapter(adapter, tmp_path / "E2", m, vocab=torch.arange(40))
    rounds = {str(k): 1.0 + 0.7 * min(k, 2) for k in range(1, 9)}
    (tmp_path / INDEX_FILE).write_text(
        json.dumps(
            {
                "adapters": {"2": "E2"},
                "chosen": 2,
                "agreement": {"adapter": {"2": 0.7}},
                "tokens_per_round": {"adapter": {"2": rounds}},
            }
        )
    )
    found = recorded_adapter(str(tmp_path))
    assert found == RecordedAdapter(str(tmp_path / "E2"), 2, 0.7, {int(k): v for k, v in rounds.items()})
    plan = plan_decoding(m, GPU, adapter=str(tmp_path))
    assert plan.best.options["adapter"] == str(tmp_path / "E2") and plan.best.options["chain"]
    assert plan.best.options["exit_layer"] is None and plan.best.options["draft_vocab"] is None
    (tmp_path / INDEX_FILE).write_text('{"chosen": 2, "agreement": {"adapter": {"2": "most"}}}')
    with pytest.raises(ConfigError, match=f"{INDEX_FILE} is damaged"):
        recorded_adapter(str(tmp_path / "E2"))


def test_measured_costs_take_the_lower_envelope_of_disturbed_probes():
    """Timing noise only adds time: a probe slower than a larger T's was disturbed (or runs as that T,
    ``pad_lengths``), and its cost is lowered to the larger T's (issue 19's B run timed one layer
    over 1 token above 2 tokens; a running maximum copied that to every T and hid the verification's cost)."""
    assert lower_envelope([0.030, 0.025, 0.032, 0.029, 0.033]) == [0.025, 0.025, 0.029, 0.029, 0.033]
    assert lower_envelope([]) == [] and lower_envelope([1.0]) == [1.0]
    m = lively_model("tiny-llama")
    true = {1: 1.0, 2: 1.1, 4: 1.3}

    def disturbed(name, fn, device):  # every round, T=1's layers are timed 50% slow
        kind, t = name
        return (true[t] * (1.5 if t == 1 else 1.0)) if kind == "layers" else 0.01 * true[t]

    costs = measure_costs(m, (1, 2, 4), timer=disturbed)
    layers = [x * m.num_layers for x in costs.layer]
    assert layers[0] == pytest.approx(layers[1]) and layers[1] < layers[2]  # T=1 lowered to T=2's time
    assert costs.verify(2) == pytest.approx(1.0, abs=0.01)  # verifying 2 tokens: about the (true) step
    assert costs.verify(4) > costs.verify(2)


def test_measured_costs_are_kept_on_disk_per_machine_engine_threads_and_batch(tmp_path, monkeypatch):
    """A new process reads what an earlier one measured on this machine (the first ``generate`` then costs no
    timing); another batch size or thread count is measured once more; a damaged store is measured again."""
    monkeypatch.setenv("FASTDECODE_COSTS", str(tmp_path))
    calls: list[int] = []
    real = cost.measure_costs
    monkeypatch.setattr(cost, "measure_costs", lambda *a, **k: calls.append(k["batch"]) or real(*a, **k))
    m = EarlyExitModel(lively_model("tiny-llama").hf)  # a wrapper of its own: nothing measured in memory
    first = decoding_costs(m)
    assert calls == [1] and first.batch == 1
    again = decoding_costs(EarlyExitModel(m.hf))  # nothing in memory: a new process
    assert calls == [1] and again == first
    wide = decoding_costs(EarlyExitModel(m.hf), batch=3)  # priced as the next power of two
    assert calls == [1, 4] and wide.batch == 4 and wide.step_seconds != first.step_seconds
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        decoding_costs(EarlyExitModel(m.hf))
    finally:
        torch.set_num_threads(threads)
    assert calls == [1, 4, 1]
    [stored] = list(tmp_path.rglob("*.json"))  # one file per model and machine
    stored.write_text("{not json")
    assert decoding_costs(EarlyExitModel(m.hf)).source == "measured" and calls == [1, 4, 1, 1]
    monkeypatch.setenv("FASTDECODE_COSTS", "off")
    decoding_costs(EarlyExitModel(m.hf))
    assert calls == [1, 4, 1, 1, 1]


def test_an_adapters_measured_cost_is_keyed_by_its_files_not_its_address(tmp_path):
    m = lively_model("tiny-llama")
    costs = decoding_costs(m)
    save_adapter(build_adapter(m, 2).eval(), tmp_path / "E2", m)
    first = load_adapter(tmp_path / "E2", m)[0]
    timed = exit_draft_cost(costs, m, 2, adapter=first)
    assert exit_draft_cost(costs, m, 2, adapter=load_adapter(tmp_path / "E2", m)[0]) == timed  # same files
    assert drafter_key(first, None) == drafter_key(load_adapter(tmp_path / "E2", m)[0], None)
    other = build_adapter(m, 2, init="last")  # in memory: keyed by its weights, never by id()
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    assert drafter_key(other, None) != drafter_key(build_adapter(m, 2, init="last"), None)
    assert drafter_key(first, torch.arange(5)) != drafter_key(first, torch.arange(6))


def quick_timer(name, fn, device):
    """A timer that runs nothing: ``measure_costs`` probes priced by their T (layers 1 ms, head 0.1 ms)."""
    return (1e-3 if name[0] == "layers" else 1e-4) * name[1]


def test_loads_that_differ_in_dtype_attention_or_versions_are_kept_apart(tmp_path, monkeypatch):
    """The weights' fingerprint rounds sampled values to bf16, so an fp32 and a bf16 load of the same weights
    share it: the stored entry is keyed by the dtype too (and the attention and the library versions), so
    neither load is priced by the other's timings."""
    monkeypatch.setenv("FASTDECODE_COSTS", str(tmp_path))
    calls: list[str] = []
    real = cost.measure_costs

    def counted(m, *args, **kwargs):
        calls.append(str(m.dtype))
        return real(m, *args, timer=quick_timer, **kwargs)

    monkeypatch.setattr(cost, "measure_costs", counted)
    fp32 = lively_model("tiny-llama").hf
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    assert weights_fingerprint(fp32) == weights_fingerprint(bf16)  # one store file for both
    decoding_costs(EarlyExitModel(fp32))
    decoding_costs(EarlyExitModel(bf16))
    assert calls == ["torch.float32", "torch.bfloat16"]
    [stored] = list(tmp_path.rglob("*.json"))
    keys = list(json.loads(stored.read_text())["entries"])
    assert len(keys) == 2 and ["dtype=float32" in k for k in keys] == [True, False]
    assert all(
        f"torch={torch.__version__}" in k and "transformers=" in k and "fastdecode=" in k for k in keys
    )
    decoding_costs(EarlyExitModel(bf16))  # each load reads its own entry back
    decoding_costs(EarlyExitModel(fp32))
    assert len(calls) == 2
    eager = copy.deepcopy(fp32)
    eager.config._attn_implementation = "eager"
    decoding_costs(EarlyExitModel(eager))
    assert len(calls) == 3  # another attention implementation: measured
    version = identity.package_version
    monkeypatch.setattr(
        identity, "package_version", lambda name: "9.9" if name == "transformers" else version(name)
    )
    decoding_costs(EarlyExitModel(fp32))
    assert len(calls) == 4  # another transformers: measured
    assert len(json.loads(stored.read_text())["entries"]) == 4


def test_the_eagle3_heads_price_is_timed_against_a_step_of_the_same_measurement():
    """A head's drafted token over a plain step timed beside it (interleaved), never over the cost model's
    ``step_seconds``: that one may come from the store, timed by another process on another day."""
    m = lively_model("tiny-llama")
    head = (
        Eagle3Head(Eagle3Config.from_target(m.config, draft_vocab_size=m.vocab_size, aux_layer_ids=[1, 2, 3]))
        .to(m.dtype)
        .eval()
    )
    costs = decoding_costs(m)
    names = []

    def timer(name, fn, device):
        fn()
        names.append(name)
        return {("eagle3_draft",): 0.002, ("step",): 0.01}[name]

    assert measure_head(m, head, timer=timer) == pytest.approx(0.2)
    assert names.count(("step",)) == names.count(("eagle3_draft",)) == HEAD_REPEATS + 1
    assert head_token_cost(costs, m, head) == pytest.approx(0.2)  # kept on the model
    wrong = replace(costs, step_seconds=costs.step_seconds * 1000)  # a stored step from another session
    assert head_token_cost(wrong, m, head) == pytest.approx(0.2)
    fresh = EarlyExitModel(m.hf)  # nothing measured in memory: timed for real, against its own step
    assert 0.01 < head_token_cost(wrong, fresh, head) < 5.0
    assert len(names) == 2 * (HEAD_REPEATS + 1)
