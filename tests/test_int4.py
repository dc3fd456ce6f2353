"""4-bit and 8-bit weights (``decoder.weights``): GGUF blocks read bit for bit, packed products equal to the
dequantised weights, ``auto`` choosing shipped blocks only where they are exact, and every lossless decoder on
the 4-bit path equal to its own autoregressive decoding."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastdecode.config import ConfigError
from fastdecode.decoding.common import configure_engine, probabilities
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.policies import POLICIES
from fastdecode.registry import DECODERS
from fastdecode.runtime import gguf_blocks
from fastdecode.runtime.gguf_blocks import Q4_0, Q4_1, Q8_0, decode_rows, read_blocks, unpermute_rows
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.runtime.quant_linear import (
    PACK_ROWS,
    Int4Linear,
    Int8Linear,
    Stacked,
    pack_int4,
    quantize_blocks,
)
from fastdecode.runtime.weights import exact_blocks
from tests.helpers import lively_model, pair_pvalues, random_prompts, tiny_model, tiny_vocab_model

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

TYPES = {
    Q4_0: gguf.GGMLQuantizationType.Q4_0,
    Q4_1: gguf.GGMLQuantizationType.Q4_1,
    Q8_0: gguf.GGMLQuantizationType.Q8_0,
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (convert_hf_to_gguf.py's ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------------------
# Blocks
@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q8_0])
def test_blocks_decode_as_gguf_dequantises(kind):
    w = np.random.default_rng(kind).standard_normal((48, 96)).astype(np.float32)
    raw = quantize(w, TYPES[kind])
    blocks = decode_rows(kind, raw)
    expected = gguf.quants.dequantize(raw, TYPES[kind])
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))
    assert blocks.codes.shape == (48, 96) and blocks.scale.shape == (48, 3)
    low, high = (-128, 127) if kind == Q8_0 else (0, 15)
    assert low <= int(blocks.codes.min()) and int(blocks.codes.max()) <= high


def test_unpermute_rows_inverts_the_converter():
    rows = np.arange(12 * 5).reshape(12, 5)
    for heads in (1, 2, 3, 6):
        assert np.array_equal(unpermute_rows(llama_cpp_permute(rows, heads), heads), rows)
    assert not np.array_equal(unpermute_rows(rows, 2), rows)


# --------------------------------------------------------------------------------------------------------
# Products
@pytest.mark.parametrize("kinds", [("q4_1",), ("q4_0",), ("q8_0",), ("q4_1", "q4_0", "q4_1")])
def test_int4_products_read_the_blocks_exactly(kinds):
    """With fp32 products the kernel computes ``x @ dequantised.T`` to fp32 rounding: codes, scales, Q8_0
    halves, fused parts and padded rows (N = 3 * 40, not a multiple of 16) are laid out exactly."""
    gen = torch.Generator().manual_seed(0)
    parts = []
    for kind in kinds:
        w = torch.randn(40, 64, generator=gen)
        raw = quantize(w.numpy(), TYPES[{"q4_0": Q4_0, "q4_1": Q4_1, "q8_0": Q8_0}[kind]])
        parts.append(decode_rows({"q4_0": Q4_0, "q4_1": Q4_1, "q8_0": Q8_0}[kind], raw))
    weight = torch.cat([b.dequantize() for b in parts])
    bias = torch.randn(weight.shape[0], generator=gen)
    x = torch.randn(2, 5, 64, generator=gen)
    ref = F.linear(x, weight, bias)
    exact = Int4Linear(parts, bias, products=torch.float32)(x)
    assert exact.shape == ref.shape and exact.dtype == torch.float32
    assert (exact - ref).abs().max() <= 1e-5 * ref.abs().max()
    fast = Int4Linear(parts, bias)(x)  # bf16 activations and scales: the stated numerics
    assert (fast - ref).abs().max() <= 2**-6 * ref.abs().max()
    assert (fast - ref).abs().max() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA tinygemm int4 kernels need a CUDA GPU")
@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
def test_int4_products_on_cuda_read_the_blocks(kind):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(kind))
    blocks = decode_rows(kind, quantize(w.numpy(), TYPES[kind]))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    ref = F.linear(x, blocks.dequantize())
    y = Int4Linear([blocks], device="cuda")(x.cuda()).cpu()
    assert y.shape == ref.shape and (y - ref).abs().max() <= 2**-6 * ref.abs().max()


def test_a_layer_shipped_in_q4_and_q8_0_runs_each_part_exactly(tmp_path):
    """GGUFs often keep some tensors in Q8_0 (here v): the fused q/k/v product runs each kind on its own."""
    hf = copy.deepcopy(lively_model("tiny-llama", 1.0).hf)
    path = tmp_path / "mixed.gguf"
    write_gguf(path, hf, kind=Q4_1, overrides={"attn_v": Q8_0})
    gguf_blocks.register(hf, path)
    m = EarlyExitModel(hf)
    weights = m.resolve_weights("auto")
    assert weights.key == "int4-shipped"
    configure_engine(m, DecodeConfig(max_new_tokens=4, weights="auto"))
    qkv = m.engine.layers[0].qkv
    assert isinstance(qkv, Stacked) and [p.kinds for p in qkv.parts] == [("q4_1",), ("q4_1",), ("q8_0",)]
    prompts = random_prompts(3, seed=2)
    cfg = DecodeConfig(max_new_tokens=12, weights="auto")
    ref = DECODERS["autoregressive"](m, prompts, cfg).tokens
    assert DECODERS["self_speculative"](m, prompts, replace(cfg, exit_layer=1)).tokens == ref


def test_quantise_at_load_bounds_the_error():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    four, eight = quantize_blocks(w, 4), quantize_blocks(w, 8)
    for blocks in (four, eight):
        err = (blocks.dequantize() - w).abs().view(32, 2, 32)
        assert (err <= blocks.scale[..., None] * 0.5 + 1e-3 * blocks.scale[..., None]).all()
    assert four.kind == "q4_1" and eight.kind == "q8_0"
    y = Int8Linear(w)(torch.randn(3, 64))
    assert y.shape == (3, 32) and y.dtype == torch.float32


# --------------------------------------------------------------------------------------------------------
# Choosing the weights
def test_auto_is_fp32_without_shipped_blocks_and_int4_is_a_different_model():
    m = EarlyExitModel(tiny_model("tiny-llama")[0])
    assert m.resolve_weights("auto").kind == "fp32"
    int4 = m.resolve_weights("int4")
    assert int4.kind == "int4" and "quantised at load" in int4.label and int4.key == "int4"
    assert "different model" in m.resolve_weights("int8").label
    with pytest.raises(ConfigError, match="weights"):
        DecodeConfig(max_new_tokens=4, weights="int3")


def write_gguf(path, hf_model, kind=Q4_1, overrides=None) -> None:
    """A GGUF of ``hf_model`` as llama.cpp's converter writes one (q/k rows interleaved), 4-bit linears and a
    Q8_0 embedding; the model's weights are then set to what the file encodes (a model loaded from it)."""
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    names = {v: k for k, v in gguf_blocks.LAYER_NAMES.items()}
    state = dict(hf_model.named_parameters())
    for name, param in state.items():
        if name == "model.embed_tokens.weight":
            gname, qtype, perm = "token_embd.weight", Q8_0, None
        elif name.endswith("_proj.weight"):
            index, module = name.split(".")[2], ".".join(name.split(".")[3:5])
            gname, qtype = f"blk.{index}.{names[module]}.weight", (overrides or {}).get(names[module], kind)
            perm = {
                "self_attn.q_proj": cfg.num_attention_heads,
                "self_attn.k_proj": cfg.num_key_value_heads,
            }.get(module)
        else:
            continue
        w = param.detach().numpy()
        if perm:
            w = llama_cpp_permute(w, perm)
        raw = quantize(w, TYPES[qtype])
        writer.add_tensor(gname, raw, raw_dtype=TYPES[qtype])
        back = gguf.quants.dequantize(raw, TYPES[qtype])
        if perm:
            back = unpermute_rows(back, perm)
        with torch.no_grad():
            param.copy_(torch.from_numpy(back))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def shipped_llama(tmp_path_factory):
    """A tiny Llama whose weights are what a Q4_1 GGUF of it ships (tied embedding/head in Q8_0)."""
    hf = copy.deepcopy(lively_model("tiny-llama", 1.0).hf)
    hf.config.tie_word_embeddings = True
    hf.tie_weights()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, hf)
    gguf_blocks.register(hf, path)
    return EarlyExitModel(hf), path


def test_auto_reads_shipped_blocks_bit_for_bit(shipped_llama):
    m, path = shipped_llama
    arch, found = read_blocks(path, m.config.num_attention_heads, m.config.num_key_value_heads)
    params = dict(m.hf.named_parameters())
    assert arch == "llama" and len(found) == 1 + 7 * m.num_layers
    for name, tensor in found.items():
        assert torch.equal(tensor.blocks().dequantize(), params[name].detach()), name
        assert tensor.shape == tuple(params[name].shape)
    weights = m.resolve_weights("auto")
    assert weights.kind == "int4" and weights.key == "int4-shipped"
    assert weights.label.startswith("Q4_1/Q8_0 blocks as shipped")
    configure_engine(m, DecodeConfig(max_new_tokens=4, weights="auto"))
    head = m.engine.head
    assert isinstance(head, Int4Linear) and head.kinds == ("q8_0",) and head.repeat == 2
    assert len(exact_blocks(m.hf, verify=True)) == len(found)  # every value compared
    with torch.no_grad():  # a changed parameter: the blocks no longer encode it, auto goes back to fp32
        params["model.layers.0.mlp.up_proj.weight"][0, 0] += 1.0
    try:
        assert m.resolve_weights("auto").kind == "fp32"
        assert "quantised at load" in m.resolve_weights("int4").label
        assert len(exact_blocks(m.hf)) == len(found) - 1
    finally:
        with torch.no_grad():
            params["model.layers.0.mlp.up_proj.weight"][0, 0] -= 1.0
    gguf_blocks.register(m.hf, path)  # (as a load of the same values would)
    assert m.resolve_weights("auto").key == "int4-shipped"


def test_a_parameter_that_differs_from_its_blocks_is_refused_when_verified(tmp_path):
    hf = copy.deepcopy(lively_model("tiny-llama", 1.0).hf)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, kind=Q4_0)
    with torch.no_grad():
        hf.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
    gguf_blocks.register(hf, path)  # registered after the change: only a value check can tell
    assert len(exact_blocks(hf)) == len(read_blocks(path, 4, 2)[1])
    with pytest.raises(ConfigError, match="k_proj.weight differs from the blocks"):
        exact_blocks(hf, verify=True)


def test_packing_in_row_chunks_lays_out_the_whole():
    codes = torch.randint(
        0, 16, (PACK_ROWS + 48, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    assert torch.equal(pack_int4(codes, torch.device("cpu")), whole)


def test_int4_logits_stay_close_to_the_fp32_model(shipped_llama):
    m, _ = shipped_llama
    ids = torch.tensor([random_prompts(1, seed=3, longest=12)[0]])
    with torch.no_grad():
        ref = m.hf(ids).logits
    cfg = DecodeConfig(max_new_tokens=1, weights="int4")
    configure_engine(m, cfg)
    with torch.no_grad():
        positions = torch.arange(ids.shape[1])[None]
        hidden = m.run_layers(m.embed(ids, positions), 0, m.num_layers, positions)
        logits = m.exit_logits(hidden)
    configure_engine(m, DecodeConfig(max_new_tokens=1, weights="fp32"))
    err = (logits - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.05


# --------------------------------------------------------------------------------------------------------
# Lossless within the 4-bit path
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("weights", ["int4", "fp32"])
def test_verifying_tokens_together_is_bitwise_decoding_them_one_by_one(weights, static):
    """Logits of 6 tokens verified in one forward equal, bit for bit, those of 6 one-token steps on the
    4-bit path (attention one query at a time: SDPA's rounding depends on the number of queries, at SmolLM2's
    head size of 64 and 70 cached tokens it differs, and bf16 products turn that into flipped tokens). The
    fp32 path computes them together: equal to rounding only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=261, num_hidden_layers=2, **shape)).eval()
    m = EarlyExitModel(hf)
    configure_engine(m, DecodeConfig(max_new_tokens=8, weights=weights, static_cache=static))
    tokens = torch.tensor([[7, 11, 13, 17, 19, 23]])
    for length in (3, 70):
        prompt = torch.randint(5, 200, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            one = m.new_cache(1, 128)
            m.forward(prompt, one)
            stepped = torch.cat([m.forward(tokens[:, i : i + 1], one) for i in range(6)], 1)
            together = m.new_cache(1, 128)
            m.forward(prompt, together)
            verified = m.forward(tokens, together)
        if weights == "int4":
            assert torch.equal(verified, stepped), length
        else:
            assert torch.allclose(verified, stepped, atol=1e-4), length


def test_verifying_a_token_tree_is_bitwise_decoding_each_branch():
    """A tree's nodes (a and b after the prompt, c after a) verified in one forward give, bit for bit, the
    logits one-token steps down each branch give: each node attends to the prefix and its ancestors only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}
    m = EarlyExitModel(LlamaForCausalLM(LlamaConfig(vocab_size=261, num_hidden_layers=2, **shape)).eval())
    configure_engine(m, DecodeConfig(max_new_tokens=8, weights="int4"))
    prompt = torch.randint(5, 200, (1, 70), generator=torch.Generator().manual_seed(70))
    a, b, c = 7, 11, 13
    with torch.no_grad():
        branches = {}
        for path in ((a, c), (b,)):
            cache = m.new_cache(1, 128)
            m.forward(prompt, cache)
            branches[path] = [m.forward(torch.tensor([[t]]), cache)[0, 0] for t in path]
        cache = m.new_cache(1, 128)
        m.forward(prompt, cache)
        cache.block = (70, torch.tensor([[[1, 0, 0], [0, 1, 0], [1, 0, 1]]], dtype=torch.bool))
        positions = torch.tensor([[70, 70, 71]])
        tree = m.forward(torch.tensor([[a, b, c]]), cache, position_ids=positions)[0]
    assert torch.equal(tree[0], branches[(a, c)][0]) and torch.equal(tree[2], branches[(a, c)][1])
    assert torch.equal(tree[1], branches[(b,)][0])


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-opt"])
def test_self_speculation_on_quantised_weights_equals_its_autoregressive_decoding(name, weights):
    m = lively_model(name, 0.1)
    prompts = random_prompts(8, seed=11)
    base = DecodeConfig(
        max_new_tokens=16, draft_tokens=4, eos_token_id=m.config.eos_token_id, weights=weights
    )
    ref = DECODERS["autoregressive"](m, prompts, base).tokens
    assert [DECODERS["autoregressive"](m, [p], base).tokens[0] for p in prompts[:3]] == ref[:3]
    assert ref != DECODERS["autoregressive"](m, prompts, replace(base, weights="fp32")).tokens
    for exit_layer, policy in itertools.product(range(1, m.num_layers), POLICIES):
        cfg = replace(base, exit_layer=exit_layer, policy=policy)
        assert DECODERS["self_speculative"](m, prompts, cfg).tokens == ref, (exit_layer, policy)
    assert DECODERS["prompt_lookup"](m, prompts, base).tokens == ref


# --------------------------------------------------------------------------------------------------------
# The real file
@pytest.mark.slow
def test_smollm2_runs_its_shipped_blocks_bit_for_bit():
    """SmolLM2-135M's GGUF: all 211 quantised tensors (210 Q4_1, the tied head Q8_0) equal the converted fp32
    weights value for value; ``auto`` reads them; the 4-bit logits stay near fp32's; lossless decoders on
    the 4-bit path equal its autoregressive decoding."""
    from fastdecode.config import ModelConfig, load_group
    from fastdecode.runtime.loading import load_model

    hf, tok = load_model(load_group("model", "smollm2-135m", ModelConfig))
    m = EarlyExitModel(hf)
    assert len(exact_blocks(hf, verify=True)) == 7 * m.num_layers + 1
    weights = m.resolve_weights("auto")
    assert weights.key == "int4-shipped" and weights.label.startswith("Q4_1/Q8_0 blocks as shipped")
    prompts = [
        tok(text)["input_ids"] for text in ("The capital of France is", "def fibonacci(n):\n", "Once upon")
    ]
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        ref = hf(ids).logits
        configure_engine(m, DecodeConfig(max_new_tokens=1))
        positions = torch.arange(ids.shape[1])[None]
        logits = m.exit_logits(m.run_layers(m.embed(ids, positions), 0, m.num_layers, positions))
    err = ((logits - ref).abs().max() / ref.abs().max()).item()
    print(f"\nSmolLM2 4-bit vs fp32 logits: max relative error {err:.4f}")
    assert 0 < err < 0.1
    cfg = DecodeConfig(max_new_tokens=32, eos_token_id=sorted(set(tok.all_special_ids)))
    for prompt in prompts:  # one row at a time: bitwise (a batch's holes leave rounding-level differences)
        ref = DECODERS["autoregressive"](m, [prompt], cfg)
        assert ref.weights == weights.label
        for decoder, options in (("self_speculative", {"exit_layer": 12}), ("prompt_lookup", {})):
            out = DECODERS[decoder](m, [prompt], replace(cfg, **options))
            assert out.tokens == ref.tokens, decoder


def engine_joint(m: EarlyExitModel, prompt: list[int], n: int, cfg: DecodeConfig) -> torch.Tensor:
    """``exact_joint`` of the model the engine runs (its weights): P(t1..tn | prompt) as ``[V] * n``."""
    vocab = m.vocab_size
    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=n - 1)))
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
    configure_engine(m, cfg)
    with torch.no_grad():
        probs = probabilities(m.forward(ids)[:, len(prompt) - 1 :], cfg)  # [V^(n-1), n, V]
    joint = torch.ones(len(prefixes))
    for i in range(n - 1):
        joint = joint * probs[torch.arange(len(prefixes)), i, prefixes[:, i]]
    return (joint[:, None] * probs[:, -1]).reshape([vocab] * n)


def test_speculative_sampling_on_int4_samples_the_int4_model():
    """Self-speculative sampling on the 4-bit path draws from the 4-bit model's distribution (4000 rows, every
    adjacent pair's chi-square test), and the test can tell it from the fp32 model's."""
    m = EarlyExitModel(copy.deepcopy(tiny_vocab_model().hf))
    prompt, samples = [3, 1, 4, 1, 5], 4000
    cfg = DecodeConfig(
        max_new_tokens=4, temperature=1.0, exit_layer=1, draft_tokens=3, seed=1, weights="int4"
    )
    joint = engine_joint(m, prompt, 4, cfg)
    out = DECODERS["self_speculative"](m, [prompt] * samples, cfg)
    assert out.weights.startswith("int4") and 0.2 < out.acceptance_rate < 0.95
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3
    fp32 = engine_joint(m, prompt, 4, replace(cfg, weights="fp32"))
    assert min(pair_pvalues(out.tokens, fp32)) < 1e-6


@pytest.mark.parametrize("tree", [False, True])
def test_every_drafter_on_int4_equals_its_autoregressive_decoding(tree):
    """EAGLE-3 (chains and EAGLE-2 trees), suffix decoding and prompt lookup (chains and trees) and, for
    chains, Jacobi iteration: greedy output on the 4-bit path token-identical to 4-bit autoregressive."""
    from tests.eagle3_heads import head_dir, training_sequences

    m = lively_model("tiny-llama", 0.1)
    seqs = training_sequences(m)
    prompts = [seqs[i, : 8 + 3 * i].tolist() for i in range(4)] + [p * 3 for p in random_prompts(3, seed=4)]
    eos = m.config.eos_token_id
    base = DecodeConfig(
        max_new_tokens=20, draft_tokens=4, costs="estimated", eos_token_id=eos, weights="int4"
    )
    ref = DECODERS["autoregressive"](m, prompts, base).tokens
    trees = {"eagle3": {"tree": tree}, "suffix": {"tree": tree}, "lookup": {"tree": tree}}
    runs = {
        "eagle3": replace(base, drafter=head_dir(m), groups={"eagle3": trees["eagle3"]}),
        "suffix": replace(base, groups={"suffix": trees["suffix"]}),
        "prompt_lookup": replace(base, groups={"lookup": trees["lookup"]}),
    }
    if not tree:
        runs["jacobi"] = base
    for name, cfg in runs.items():
        out = DECODERS[name](m, prompts, cfg)
        assert out.tokens == ref, name
        assert out.weights == ref_weights(m), name
        if name != "jacobi":
            assert 0 < sum(out.accepted) <= sum(out.drafted), name


def ref_weights(m: EarlyExitModel) -> str:
    return m.resolve_weights("int4").label


def test_the_cost_store_names_a_gguf_loaded_model_without_reading_its_float_weights(tmp_path):
    """``weights_key``: the file's digest while the parameters are as loaded, the sampled fingerprint once
    one changes; stored identities (adapters, feature caches) keep the fingerprint either way."""
    from fastdecode.runtime.identity import weights_fingerprint, weights_key

    hf = copy.deepcopy(lively_model("tiny-llama", 1.0).hf)
    write_gguf(tmp_path / "tiny.gguf", hf)
    sampled = weights_fingerprint(hf)
    assert weights_key(hf) == sampled  # not registered: nothing else names it
    gguf_blocks.register(hf, tmp_path / "tiny.gguf", digest="pkg==1:tiny.gguf:abc")
    key = weights_key(hf)
    assert key != sampled and weights_fingerprint(hf) == sampled
    with torch.no_grad():
        hf.model.norm.weight.add_(1.0)
    assert weights_key(hf) == weights_fingerprint(hf) != sampled


def test_quantised_weights_refuse_widths_the_groups_do_not_divide():
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1}
    m = EarlyExitModel(LlamaForCausalLM(LlamaConfig(vocab_size=64, num_hidden_layers=1, **shape)).eval())
    for weights in ("int4", "int8"):
        with pytest.raises(
            ConfigError, match=rf"weights={weights} needs every product's input width divisible"
        ):
            DECODERS["autoregressive"](m, [[1, 2, 3]], DecodeConfig(max_new_tokens=2, weights=weights))
    assert DECODERS["autoregressive"](m, [[1, 2, 3]], DecodeConfig(max_new_tokens=2)).weights == "fp32"
