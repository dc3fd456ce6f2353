"""The execution engine (fastdecode/runtime/engine.py, fast_linear.py, the static cache): every kernel equals
``F.linear`` within rounding, engine layers equal HF's layers for every family and cache mode, packed copies
follow in-place weight changes, training never runs them, the compiled path decodes like the reference."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch import nn

from fastdecode.config import CONFIG_DIR, ConfigError
from fastdecode.decoding.config import DecodeConfig
from fastdecode.registry import DECODERS
from fastdecode.runtime.cache import CAPACITY_BUCKET, KVCache, StaticKVCache
from fastdecode.runtime.engine import EngineOptions, RotaryLayer, default_options
from fastdecode.runtime.fast_linear import FastLinear, available_kernels, calibrate, uniform_plan
from fastdecode.runtime.model import EarlyExitModel
from tests.conftest import ENGINES, REFERENCE, TINY_MODELS
from tests.helpers import (
    kernel_tolerance,
    linear_tolerance,
    lively_model,
    model_tolerance,
    random_prompts,
    tiny_model,
)

KERNELS = available_kernels(torch.device("cpu"), torch.float32)
ENGINE_OPTIONS = {
    "fast": EngineOptions(),
    "packed": EngineOptions(kernel="mkl"),
    "static": EngineOptions(kernel="dnn", static_cache=True),
    "hf-packed": EngineOptions(fast_layers=False, kernel="dnn"),
}


# --------------------------------------------------------------------------------------------------------
# FastLinear
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
def test_every_kernel_equals_f_linear_at_every_row_count(kernel, bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    lin = FastLinear(weight, b)
    lin.set_plan(uniform_plan(kernel, available=KERNELS))
    for rows in [1, 2, 3, 5, 9, 17, 32, 33, 70]:
        for shape in [(rows, 40), (1, rows, 40)]:
            x = torch.randn(shape, generator=gen)
            with torch.inference_mode():
                torch.testing.assert_close(lin(x), F.linear(x, weight, b), **linear_tolerance(x, weight, b))


def test_plans_are_checked_and_packs_follow_the_plan():
    lin = FastLinear(torch.randn(8, 4))
    with pytest.raises(ValueError, match="mkl packs are for M = 1"):
        lin.set_plan(["linear", "mkl"])
    if "dnn" in KERNELS:
        lin.set_plan(["dnn"] * 4)
        assert set(lin.packed) == {"dnn"}
        lin.set_plan(["linear"] * 4)
        assert lin.packed == {}  # unused packs are dropped


def test_calibration_picks_a_valid_plan_and_drops_a_wrong_kernel():
    class Wrong(FastLinear):  # a "dnn" kernel that is off by one: must never be chosen
        def _kernel(self, name):
            if name == "dnn":
                return lambda x: F.linear(x, self.weight, self.bias) + 1
            return super()._kernel(name)

    group = [Wrong(torch.randn(64, 32)) for _ in range(3)]
    plan, timings = calibrate(group, ("linear", "dnn"), rows=(1, 2, 4), repeats=1)
    assert plan == ["linear"] * 4 and all("dnn" not in t for t in timings.values())
    good = [FastLinear(torch.randn(64, 32)) for _ in range(3)]
    plan, timings = calibrate(good, KERNELS, rows=(1, 2, 4), repeats=1)
    assert len(plan) == 4 and set(plan) <= set(KERNELS) and all(k != "mkl" for k in plan[1:])
    assert all(lin.plan == tuple(plan) for lin in good)


def test_fused_projection_is_the_side_by_side_outputs():
    gen = torch.Generator().manual_seed(1)
    parts = [nn.Linear(16, n, bias=b) for n, b in [(8, True), (4, False), (4, True)]]
    fused = FastLinear.fuse(parts)
    fused.set_plan(uniform_plan("dnn", available=KERNELS))
    x = torch.randn(3, 16, generator=gen)
    with torch.inference_mode():
        tol = linear_tolerance(x, fused.weight, fused.bias)
        torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], -1), **tol)
    assert not fused.stale()
    with torch.no_grad():
        parts[1].weight.mul_(2)
    assert fused.stale()


def test_engine_packs_a_drafter_beside_the_model_once():
    """``Engine.packed``: a copy of a module run beside the model (a drafter's head) with packed linears over
    the same weights (outputs equal), built once per module; the module itself without ``fast_linear``."""
    m = _fresh("tiny-llama")
    drafter = nn.Sequential(nn.Linear(16, 48), nn.SiLU(), nn.Linear(48, 8, bias=False))
    x = torch.randn(3, 16)
    engine = m.use_engine(default_options(m.device, fast_linear=True))
    with torch.inference_mode():
        packed = engine.packed(drafter)
        assert packed is engine.packed(drafter) and packed is not drafter
        assert [type(mod) for mod in packed] == [FastLinear, nn.SiLU, FastLinear]
        assert packed[0].weight.data_ptr() == drafter[0].weight.data_ptr()  # shared, not copied
        assert all(mod.plan for mod in packed if isinstance(mod, FastLinear))
        # two linears, sums over 16 inputs and the bias then over 48: the second's terms, and the first's
        # terms carried through the second's weights
        first, second = drafter[0], drafter[2]
        carried = (x.abs() @ first.weight.abs().T + first.bias.abs()) @ second.weight.abs().T
        size = torch.maximum(carried, drafter[1](first(x)).abs() @ second.weight.abs().T)
        tol = kernel_tolerance(torch.float32, 17 + 48, float(size.max()))
        for rows in (1, 3):
            torch.testing.assert_close(packed(x[:rows]), drafter(x[:rows]), **tol)
    assert isinstance(drafter[0], nn.Linear)  # the original is untouched
    plain = m.use_engine(EngineOptions(fast_linear=False))
    assert plain.packed(drafter) is drafter


# --------------------------------------------------------------------------------------------------------
# Engine layers against HF's layers
def _fresh(name: str) -> EarlyExitModel:
    return EarlyExitModel(lively_model(name).hf)  # a new one (own engines) over the shared lively weights


@pytest.mark.parametrize("variant", ENGINE_OPTIONS)
@pytest.mark.parametrize("name", TINY_MODELS)
def test_engine_forward_and_cached_decoding_equal_the_hf_layers(name, variant):
    """Full forward (no cache), and token-by-token + block decoding on the cache the engine asks for, equal
    the HF modules' logits within fp32 rounding; the lean path serves exactly the rotary families."""
    m = _fresh(name)
    ids = torch.tensor([random_prompts(1, seed=3, longest=12)[0] + [7, 8, 9]])
    with torch.inference_mode():
        m.use_engine(None)
        ref = m.forward(ids)
        engine = m.use_engine(ENGINE_OPTIONS[variant])
        assert engine.lean == (name != "tiny-opt" and ENGINE_OPTIONS[variant].fast_layers)
        tol = model_tolerance(m.config, ids.shape[1], ref)  # other kernels, the cache, other blocks
        torch.testing.assert_close(m.forward(ids), ref, **tol)
        cache = m.new_cache(1, 4)  # grows (the static one to a bucket)
        assert isinstance(cache, StaticKVCache) == ENGINE_OPTIONS[variant].static_cache
        steps = [m.forward(ids[:, :5], cache=cache)]
        for t in range(5, ids.shape[1] - 3):
            steps.append(m.forward(ids[:, t : t + 1], cache=cache))
        steps.append(m.forward(ids[:, -3:], cache=cache))  # a verification-like block of 3
        torch.testing.assert_close(torch.cat(steps, 1), ref, **tol)
    m.use_engine(None)


def test_lean_layer_is_hf_layer_math():
    """One RotaryLayer against the HF LlamaDecoderLayer it was built from, with a cache and a mask."""
    m = _fresh("tiny-llama")
    engine = m.use_engine(EngineOptions(fast_linear=False))
    assert all(isinstance(layer, RotaryLayer) for layer in engine.layers)
    hidden = torch.randn(2, 5, m.config.hidden_size)
    pos = torch.arange(5).expand(2, -1)
    with torch.inference_mode():
        outs = []
        for use in (None, engine.options):
            m.use_engine(use)
            cache = m.new_cache(2, 8)
            cache.reserve(torch.tensor([[False, True, True, True, True]] * 2), 0, pos)
            outs.append(m.run_layers(hidden, 0, m.num_layers, pos, cache=cache))
    torch.testing.assert_close(outs[1], outs[0], **model_tolerance(m.config, 5, outs[0]))


def test_fallback_layers_are_inference_copies_sharing_the_parameters():
    m = _fresh("tiny-opt")
    engine = m.use_engine(EngineOptions(kernel="dnn"))
    assert not engine.lean
    copy = engine.layers[0]
    assert copy is not m.layers[0] and isinstance(copy.fc1, FastLinear)
    assert isinstance(m.layers[0].fc1, nn.Linear)  # the model itself is untouched
    assert copy.fc1.weight.data_ptr() == m.layers[0].fc1.weight.data_ptr()
    assert copy.self_attn_layer_norm.weight is m.layers[0].self_attn_layer_norm.weight


# --------------------------------------------------------------------------------------------------------
# Packed copies follow in-place changes; training never sees them
def test_engine_is_rebuilt_after_an_in_place_weight_change():
    m = EarlyExitModel(lively_model("tiny-llama").hf.__class__(lively_model("tiny-llama").hf.config).eval())
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        m.use_engine(EngineOptions(kernel="mkl"))
        before = m.forward(ids)
        built = m.engine
    with torch.no_grad():
        for p in m.hf.parameters():
            p.mul_(1.5)
    with torch.inference_mode():
        after = m.forward(ids)
        assert m.engine is not built  # stale packs were rebuilt before use
        m.use_engine(None)
        reference = m.forward(ids)
    torch.testing.assert_close(after, reference, **model_tolerance(m.config, ids.shape[1], reference))
    assert not torch.allclose(after, before)


def test_training_runs_the_hf_modules_with_an_engine_selected():
    m = _fresh("tiny-llama")
    m.use_engine(EngineOptions(kernel="dnn"))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    calls = []
    handle = m.layers[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        loss = m.forward(ids).logsumexp(-1).mean()  # gradients on: the HF layers run
        loss.backward()
    finally:
        handle.remove()
    assert calls and m.layers[0].self_attn.q_proj.weight.grad is not None
    m.hf.zero_grad(set_to_none=True)
    with torch.inference_mode():
        m.forward(ids)
    assert len(calls) == 1  # inference used the engine's layers, not the hooked HF module


# --------------------------------------------------------------------------------------------------------
# Static cache and masks
def test_static_cache_writes_at_slots_and_spans_its_capacity():
    cache = StaticKVCache(2, 1, 1, 2, 10, torch.float32, "cpu")
    assert cache.capacity == CAPACITY_BUCKET and cache.static
    cache.reserve(torch.ones(1, 3, dtype=torch.bool), 0)
    cache.begin(0, 3)
    k, _ = cache.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2), 0)
    assert k.shape[2] == CAPACITY_BUCKET and cache.lengths == [0, 0]  # pointers move in finish
    cache.finish(range(0, 1), 3)
    assert cache.lengths == [3, 0] and cache.attended(3) == CAPACITY_BUCKET
    cache.crop(1)
    assert cache.lengths == [1, 0]  # rollback: the pointer only
    cache.begin(CAPACITY_BUCKET, 2)  # past the end: grows to the next bucket
    assert cache.capacity == 2 * CAPACITY_BUCKET


def test_dense_queries_need_no_materialised_mask():
    m = _fresh("tiny-llama")
    engine = m.use_engine(EngineOptions())
    cache = m.new_cache(2, 16)
    assert type(cache) is KVCache
    cache.reserve(torch.ones(2, 4, dtype=torch.bool), 0)
    hidden, pos = torch.zeros(2, 4, 8), torch.arange(4).expand(2, -1)
    assert m._mask(hidden, None, cache, 0, None, pos, engine) is None  # causal block from slot 0
    cache.lengths = [4] * m.num_layers
    cache.reserve(torch.ones(2, 1, dtype=torch.bool), 4)
    assert m._mask(hidden[:, :1], None, cache, 4, None, pos[:, :1], engine) is None  # one query, all valid
    cache.reserve(torch.ones(2, 2, dtype=torch.bool), 4)
    assert m._mask(hidden[:, :2], None, cache, 4, None, pos[:, :2], engine) is not None  # block after past
    cache.key_valid[1, 0] = False  # a hole: the mask is needed
    assert m._mask(hidden[:, :1], None, cache, 4, None, pos[:, :1], engine) is not None
    assert m._mask(hidden[:, :1], None, cache, 4, None, pos[:, :1], None) is not None  # reference: unchanged


# --------------------------------------------------------------------------------------------------------
# Configuration
def test_engine_config_errors_and_defaults():
    with pytest.raises(ConfigError, match="Unknown linear kernel 'mkk'"):
        DecodeConfig(max_new_tokens=4, linear_kernel="mkk")
    with pytest.raises(ConfigError, match="compile=true needs the static cache"):
        DecodeConfig(max_new_tokens=4, compile=True, static_cache=False)
    assert default_options(torch.device("cpu")) == EngineOptions()
    assert default_options(torch.device("cpu"), fast_layers=False, fast_linear=False) is None
    cuda = default_options(torch.device("cuda"))  # no GPU needed: only the defaults are computed
    assert cuda is None
    assert default_options(torch.device("cuda"), compile=True).static_cache
    assert set(ENGINES["hf"]) == set(REFERENCE)


@pytest.mark.parametrize("decoder", ["autoregressive", "prompt_lookup"])
def test_the_check_changes_nothing_and_each_decoder_selects_its_engine(decoder):
    """``check`` is pure; the engine a call decodes on is the decoder's explicit ``configure_engine``."""
    from fastdecode.decoding.common import check

    m = _fresh("tiny-llama")
    prompts = random_prompts(2, seed=5, longest=6)
    cfg = DecodeConfig(max_new_tokens=3, fast_layers=True, fast_linear=True, costs="estimated")
    m.use_engine(None)
    check(cfg, m, prompts)
    assert m.engine is None  # validated, nothing switched
    DECODERS[decoder](m, prompts, cfg)
    assert m.engine is not None and m.engine.options == default_options(
        m.device, fast_layers=True, fast_linear=True
    )
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        DECODERS[decoder](m, [[m.vocab_size]], replace(cfg, fast_layers=False, fast_linear=False))
    assert m.engine is not None  # a refused call leaves the engine alone


# --------------------------------------------------------------------------------------------------------
# Compiled path (slow: inductor compiles one graph per layer range and number of new tokens)
@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["autoregressive", "self_speculative"])
def test_compiled_decoding_equals_the_reference(decoder):
    m = lively_model("tiny-llama", 0.1)
    prompts = random_prompts(3, seed=31, longest=40)  # prompts of > 32 tokens prefill eagerly
    cfg = DecodeConfig(max_new_tokens=12, exit_layer=2, draft_tokens=3, **REFERENCE)
    if decoder == "autoregressive":
        cfg = replace(cfg, exit_layer=None)
    ref = DECODERS["autoregressive"](m, prompts, replace(cfg, exit_layer=None)).tokens
    out = DECODERS[decoder](m, prompts, replace(cfg, compile=True, static_cache=None, fast_layers=None))
    assert out.tokens == ref
    assert m.engine.compile_seconds and all(s > 0 for s in m.engine.compile_seconds.values())
    again = DECODERS[decoder](m, prompts, replace(cfg, compile=True, static_cache=None, fast_layers=None))
    assert again.tokens == ref


# --------------------------------------------------------------------------------------------------------
# The benchmark entry point
def test_engine_benchmark_writes_its_report(tmp_path):
    from fastdecode_cli.engine import run

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            config_name="engine",
            overrides=[
                "model=tiny-llama",
                "exit_layer=2",
                "context=16",
                "steps=[1,2]",
                "threads=[1]",
                "repeats=1",
                "calls=1",
                "ar_new_tokens=4",
                "ar_repeats=1",
                "bf16=false",
                "bandwidth_mb=8",
                "paths=[hf,engine,static]",
                "ar_paths=[hf,engine,static]",
                "overhead_model.num_hidden_layers=3",
                f"output_dir={tmp_path}",
            ],
        )
        result = run(cfg)
    saved = json.loads((tmp_path / "engine.json").read_text())
    entry = saved["threads"]["1"]
    assert set(entry["forward"]["paths"]) == {"hf", "engine", "static"}
    assert entry["forward"]["paths"]["engine"]["model"]["2"]["vs_hf_T1"] > 0
    ar = entry["autoregressive"]["batch1"]
    assert all(r["tokens_equal_hf_generate"] for r in ar.values())  # every path decodes like HF generate
    from fastdecode.runtime.machine import machine_label

    markdown = (tmp_path / "engine.md").read_text()
    assert "Forward cost" in markdown
    assert f"## {machine_label(threads=1)}: bandwidth" in markdown  # the tok/s name the CPU and its threads
    assert result["model"] == "tiny-llama"
    assert tiny_model("tiny-llama")[0].training is False


# --------------------------------------------------------------------------------------------------------
# The default draft length (configs/decoder/self_speculative.yaml: draft_tokens: auto)
def _recorded(tmp_path, acceptance: dict[int, float]):
    """A job whose checkpoint records ``acceptance`` per exit (``final/acceptance.json``, as LayerSkip writes)."""
    from types import SimpleNamespace

    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    drafters = [{"drafter": "exit", "exit_layer": k, "acceptance": v} for k, v in acceptance.items()]
    (final / "acceptance.json").write_text(json.dumps({"format": 1, "drafters": drafters}))
    return SimpleNamespace(checkpoint=str(final))


def test_auto_draft_length_follows_the_recorded_acceptance(tmp_path):
    """Resolved after the model loads, with its measured cost model: a recorded acceptance that pays gives the
    constant K the cost model picks; a poor one or none the adaptive policy; a fixed K is left alone."""
    from types import SimpleNamespace

    from fastdecode.bench.auto import resolve_draft_tokens
    from fastdecode.bench.config import AUTO_DRAFT_CAP, Method, MethodConfig
    from fastdecode.plan.choose import choose_exit
    from fastdecode.plan.cost import estimate_costs

    m = lively_model("tiny-llama")
    costs = estimate_costs(
        m
    )  # the benchmark measures it (decoding_costs); timings would make this test flaky

    def method(draft_tokens):
        spec = MethodConfig(decoder="self_speculative", uses_exit_layer=True)
        return Method("s", spec, {"policy": "constant", "draft_tokens": draft_tokens, "exit_layer": 1}, 1)

    unrecorded = method("auto")
    resolve_draft_tokens(unrecorded, SimpleNamespace(checkpoint=None), m, costs)
    assert unrecorded.options == {"policy": "adaptive", "draft_tokens": AUTO_DRAFT_CAP, "exit_layer": 1}
    assert (
        unrecorded.draft_source.startswith("adaptive") and "no acceptance recorded" in unrecorded.draft_source
    )
    good = method("auto")
    resolve_draft_tokens(good, _recorded(tmp_path / "good", {1: 1.0, 2: 0.5}), m, costs)
    expected = choose_exit({1: 1.0}, costs, max_draft=AUTO_DRAFT_CAP)  # drafting at E=1 of 4 always agrees
    assert expected["exit"] == 1 and good.options["policy"] == "constant"
    assert good.options["draft_tokens"] == expected["draft"] >= 2
    assert good.draft_source.startswith("cost model (estimated): recorded acceptance 1.00 at E=1")
    poor = method("auto")
    resolve_draft_tokens(poor, _recorded(tmp_path / "poor", {1: 0.05}), m, costs)
    assert poor.options["policy"] == "adaptive" and poor.options["draft_tokens"] == AUTO_DRAFT_CAP
    assert "no constant K is expected to pay" in poor.draft_source
    fixed = method(3)
    resolve_draft_tokens(fixed, _recorded(tmp_path / "fixed", {1: 1.0}), m, costs)
    assert fixed.options["draft_tokens"] == 3 and fixed.options["policy"] == "constant"
    assert fixed.draft_source is None
