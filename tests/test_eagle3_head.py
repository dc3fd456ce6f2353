"""The EAGLE-3 head (fastdecode/drafters/eagle3/model.py, eagle3_layer.py) and its two checkpoint dialects
(fastdecode/drafters/eagle3/files.py), on tiny random heads."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

from fastdecode.config import ConfigError
from fastdecode.drafters.eagle3.files import Eagle3FileError, load_eagle3, save_eagle3
from fastdecode.drafters.eagle3.layer import Eagle3KV, ttt_mask
from fastdecode.drafters.eagle3.model import (
    Eagle3Config,
    Eagle3ConfigError,
    Eagle3Head,
    default_aux_layers,
    vocab_maps,
    vocab_maps_agree,
)
from fastdecode.errors import UserError
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.draft_layers import apply_rope, rope_cos_sin
from tests.helpers import eagle3_reduction, kernel_tolerance

H, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT = 32, 4, 2, 8, 64, 50, 20
KEPT = [0, 1, 2, 3, 7, 9, 11, 12, 15, 20, 21, 22, 30, 31, 33, 40, 41, 45, 48, 49]


def target_config(**extra) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=H,
        num_hidden_layers=8,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTER,
        vocab_size=VOCAB,
        rope_theta=5000.0,
        architectures=["LlamaForCausalLM"],
        **extra,
    )


def random_head(seed: int = 0, **overrides) -> Eagle3Head:
    """A head whose every parameter (norms included) is random, with the draft vocabulary ``KEPT``."""
    cfg = Eagle3Config.from_target(target_config(), draft_vocab_size=DRAFT, **overrides)
    head = Eagle3Head(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=gen))
    head.set_draft_vocab(list(reversed(KEPT)))
    return head.eval()


def inputs(b: int = 2, t: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(embeds [b, t, H], features [b, t, 3H], position_ids [b, t])``."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(t).expand(b, t) + torch.tensor([[0], [3]])[:b]
    return torch.randn(b, t, H, generator=gen), torch.randn(b, t, 3 * H, generator=gen), positions


def test_config_from_target_and_default_layers():
    cfg = Eagle3Config.from_target(target_config(), draft_vocab_size=DRAFT)
    assert cfg.aux_layer_ids == [2, 4, 5] == default_aux_layers(8)
    assert default_aux_layers(32) == [2, 16, 29]
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.head_dim, cfg.vocab_size) == (H, H, HEAD_DIM, VOCAB)
    assert cfg.rope_theta == 5000.0 and cfg.norm_before_residual is False
    assert cfg.target_architectures == ["LlamaForCausalLM"]


def test_fc_norm_with_norm_before_fc_is_refused():
    with pytest.raises(Eagle3ConfigError, match="fc_norm and norm_before_fc are mutually exclusive"):
        Eagle3Config.from_target(target_config(), draft_vocab_size=DRAFT, fc_norm=True, norm_before_fc=True)


def test_rope_scaling_is_refused():
    scaled = target_config(
        max_position_embeddings=8192,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    with pytest.raises(ConfigError, match="rope scaling 'linear'"):
        Eagle3Config.from_target(scaled, draft_vocab_size=DRAFT)


def test_rope_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = target_config()
    positions = torch.tensor([[0, 1, 5, 9]])
    x = torch.randn(1, HEADS, 4, HEAD_DIM)
    cos, sin = LlamaRotaryEmbedding(config)(x, positions)
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    ours = apply_rope(x, *rope_cos_sin(positions, HEAD_DIM, 5000.0, x.dtype))
    torch.testing.assert_close(ours, expected)


def test_shapes_and_fused_input():
    head = random_head()
    embeds, features, positions = inputs()
    logits, hidden = head(embeds, features, positions)
    assert logits.shape == (2, 6, DRAFT) and hidden.shape == (2, 6, H)
    again, _ = head(embeds, head.fuse(features), positions)  # a fused feature goes in as is
    torch.testing.assert_close(again, logits)
    with pytest.raises(ValueError, match="expected last dims"):
        head(embeds, features[..., :40], positions)


@pytest.mark.parametrize("changed", ["embeds", "features"])
def test_causal(changed):
    head = random_head()
    embeds, features, positions = inputs()
    logits, hidden = head(embeds, features, positions)
    (embeds if changed == "embeds" else features)[:, 3] += 1.0
    logits2, hidden2 = head(embeds, features, positions)
    torch.testing.assert_close(logits2[:, :3], logits[:, :3])
    torch.testing.assert_close(hidden2[:, :3], hidden[:, :3])
    assert not torch.allclose(logits2[:, 3], logits[:, 3])


def test_past_kv_equals_whole_sequence():
    head = random_head()
    embeds, features, positions = inputs(t=7)
    whole, whole_hidden = head(embeds, features, positions)
    kv = Eagle3KV()
    first, _ = head(embeds[:, :4], features[:, :4], positions[:, :4], kv=kv)
    rest, rest_hidden = head(embeds[:, 4:], features[:, 4:], positions[:, 4:], kv=kv)
    assert len(kv) == 7
    # blocks of the sequence against one pass: one head step over 7 keys, at the size of each output (the
    # raw residual, the default layer's hidden state, carries the fused feature's scale)
    reduction = eagle3_reduction(head.config, 7)
    tol = kernel_tolerance(torch.float32, reduction, float(whole.abs().max()))
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, **tol)
    hidden_tol = kernel_tolerance(torch.float32, reduction, float(whole_hidden.abs().max()))
    torch.testing.assert_close(rest_hidden, whole_hidden[:, 4:], **hidden_tol)
    kv.crop(4)  # roll back the last three and run them one at a time
    steps = [
        head(embeds[:, i : i + 1], features[:, i : i + 1], positions[:, i : i + 1], kv=kv)[0]
        for i in (4, 5, 6)
    ]
    torch.testing.assert_close(torch.cat(steps, 1), whole[:, 4:], **tol)


@torch.inference_mode()
def test_a_decoding_cache_equals_the_block_list_through_growth_and_rollback():
    """Decoding's preallocated keys (a one-layer ``KVCache``, grown past its first 64 slots, rolled back by
    the length pointer) give the head exactly what the training's list of blocks gives it."""
    head = random_head()
    embeds, features, positions = inputs(t=80)
    blocks, cache = Eagle3KV(), KVCache(1, 2, KV_HEADS, HEAD_DIM, 64, torch.float32, "cpu")
    for start, end in [(0, 60), (60, 70), (70, 75), (75, 80)]:
        part = (embeds[:, start:end], features[:, start:end], positions[:, start:end])
        want = head(*part, kv=blocks)
        got = head(*part, kv=cache)
        # keys in a preallocated buffer (its capacity, its mask) against a list: attention over other shapes
        tol = [
            kernel_tolerance(torch.float32, eagle3_reduction(head.config, 128), float(w.abs().max()))
            for w in want
        ]
        for g, w, t in zip(got, want, tol, strict=True):
            torch.testing.assert_close(g, w, **t)
        if end == 75:  # drop the last five and write them again
            blocks.crop(70)
            cache.crop(70)
            for g, w, t in zip(head(*part, kv=cache), head(*part, kv=blocks), tol, strict=True):
                torch.testing.assert_close(g, w, **t)
    assert cache.lengths[0] == len(blocks) == 80 and cache.capacity == 128


def test_ttt_mask_layout():
    mask = ttt_mask(3, 2)
    tri = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(
        mask, torch.cat([tri, torch.eye(3, dtype=torch.bool), torch.eye(3, dtype=torch.bool)], 1)
    )


def test_ttt_step_attends_to_its_prefix_and_its_own_chain():
    """Unroll step 1 under ``ttt_mask``: position t equals one query at t over step 0's keys up to t."""
    head = random_head()
    embeds, features, positions = inputs(t=5)
    kv = Eagle3KV()
    _, hidden0 = head(embeds, features, positions, kv=kv)
    step0_k, step0_v = kv.keys[0], kv.values[0]
    logits1, _ = head(embeds.roll(-1, 1), hidden0, positions + 1, kv=kv, attn_mask=ttt_mask(5, 1))
    for t in range(5):
        prefix = Eagle3KV([step0_k[:, :, : t + 1]], [step0_v[:, :, : t + 1]])
        sl = slice(t, t + 1)
        alone, _ = head(embeds.roll(-1, 1)[:, sl], hidden0[:, sl], positions[:, sl] + 1, kv=prefix)
        tol = kernel_tolerance(torch.float32, eagle3_reduction(head.config, 10), float(logits1.abs().max()))
        torch.testing.assert_close(alone[:, 0], logits1[:, t], **tol)  # one row against the masked batch


def test_draft_vocabulary_maps():
    head = random_head()
    assert torch.equal(head.draft_to_target(torch.arange(DRAFT)), torch.tensor(KEPT))
    assert torch.equal(head.t2d.nonzero().flatten(), torch.tensor(KEPT))
    assert vocab_maps_agree(head.d2t, head.t2d)
    d2t, t2d = vocab_maps(KEPT, VOCAB)
    t2d[4] = True  # one more target id than the draft vocabulary has
    assert not vocab_maps_agree(d2t, t2d)
    with pytest.raises(ValueError, match="distinct"):
        vocab_maps([1, 1, 2], VOCAB)


OPTIONS = [
    {"norm_before_residual": True},
    {},
    {"fc_norm": True},
    {"norm_before_fc": True},
]


@pytest.mark.parametrize("options", OPTIONS, ids=["normed_residual", "plain", "fc_norm", "norm_before_fc"])
def test_round_trip_in_both_dialects(tmp_path, options):
    head = random_head(**options)
    save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target", speculative_tokens=4)
    embeds, features, positions = inputs()
    expected, _ = head(embeds, features, positions)
    sglang_cfg = dataclasses.replace(head.config, target_architectures=[])  # SGLang's config has no verifier
    folders = [(tmp_path / "head", head.config)]
    if options == {}:  # the only one SGLang runs (test_eagle3_interop.py)
        folders.append((tmp_path / "head" / "sglang", sglang_cfg))
    else:
        assert not (tmp_path / "head" / "sglang").exists()
    for folder, expected_cfg in folders:
        loaded, cfg = load_eagle3(folder)
        assert cfg == expected_cfg
        assert torch.equal(loaded(embeds, features, positions)[0], expected)
        assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)


def layer_shapes(prefix: str) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H),
        f"{prefix}self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
        f"{prefix}self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
        f"{prefix}self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
        f"{prefix}mlp.gate_proj.weight": (INTER, H),
        f"{prefix}mlp.up_proj.weight": (INTER, H),
        f"{prefix}mlp.down_proj.weight": (H, INTER),
        f"{prefix}input_layernorm.weight": (H,),
        f"{prefix}hidden_norm.weight": (H,),
        f"{prefix}post_attention_layernorm.weight": (H,),
    }


def tensor_shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def test_files_of_both_dialects(tmp_path):
    head = random_head(norm_before_residual=False)  # SGLang runs only this layer
    out = save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target", speculative_tokens=4)
    common = {
        "fc.weight": (H, 3 * H),
        "norm.weight": (H,),
        "lm_head.weight": (DRAFT, H),
        "d2t": (DRAFT,),
        "t2d": (VOCAB,),
    }
    assert tensor_shapes(out / "model.safetensors") == {**common, **layer_shapes("layers.0.")}
    assert tensor_shapes(out / "sglang" / "model.safetensors") == {**common, **layer_shapes("midlayer.")}
    spec = json.loads((out / "config.json").read_text())
    assert spec["architectures"] == ["Eagle3DraftModel"] and spec["speculators_model_type"] == "eagle3"
    assert (spec["norm_before_residual"], spec["norm_before_fc"], spec["fc_norm"], spec["norm_output"]) == (
        False,
        False,
        False,
        False,
    )
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and spec["target_hidden_size"] == H
    assert spec["draft_vocab_size"] == DRAFT and spec["tie_word_embeddings"] is False
    layer = spec["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"]) == ("llama", 1, VOCAB)
    assert spec["speculators_config"] == {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": 4,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "verifier": {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]},
    }
    sgl = json.loads((out / "sglang" / "config.json").read_text())
    assert sgl["architectures"] == ["LlamaForCausalLMEagle3"] and sgl["num_hidden_layers"] == 1
    assert sgl["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4]
    }  # SGLang's k: hidden_states[k + 1]
    assert (sgl["draft_vocab_size"], sgl["vocab_size"], sgl["tie_word_embeddings"]) == (DRAFT, VOCAB, False)
    assert LlamaConfig(**sgl).rope_parameters["rope_theta"] == 5000.0  # transformers reads the RoPE base


def test_option_weights_are_named_as_speculators_names_them(tmp_path):
    head = random_head(fc_norm=True)
    out = save_eagle3(head, head.config, tmp_path / "a", verifier_name="t")
    names = set(tensor_shapes(out / "model.safetensors"))
    assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= names
    assert not (out / "sglang").exists()  # SGLang has no fc_norm: it would drop these weights
    head = random_head(norm_before_fc=True, norm_before_residual=False)
    out = save_eagle3(head, head.config, tmp_path / "b", verifier_name="t")
    assert tensor_shapes(out / "model.safetensors")["input_norm.weight"] == (3 * H,)
    assert not (out / "sglang").exists()


def saved(tmp_path):
    head = random_head(norm_before_residual=False)  # so that sglang/ is written too
    return save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target")


def test_damaged_or_foreign_directories_are_refused_by_name(tmp_path):
    out = saved(tmp_path)
    config = out / "config.json"
    text = config.read_text()
    config.write_text(text[: len(text) // 2])
    with pytest.raises(Eagle3FileError, match="config.json is not valid JSON") as err:
        load_eagle3(out)
    assert isinstance(err.value, UserError) and str(config) in str(err.value)
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(Eagle3FileError, match="is not an EAGLE-3 head"):
        load_eagle3(out)
    with pytest.raises(Eagle3FileError, match="config.json: no such file"):
        load_eagle3(tmp_path)
    weights = out / "sglang" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(Eagle3FileError, match="model.safetensors is damaged"):
        load_eagle3(out / "sglang")


def test_weights_that_do_not_match_the_config_are_refused(tmp_path):
    out = saved(tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["draft_vocab_size"] = DRAFT + 1
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(Eagle3FileError, match=r"misshapen \[.*lm_head.weight"):
        load_eagle3(out)


def test_missing_norm_before_residual_reads_the_speculators_default(tmp_path, caplog):
    out = saved(tmp_path)
    config = json.loads((out / "config.json").read_text())
    del config["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="fastdecode.drafters.eagle3.files"):
        _, cfg = load_eagle3(out)
    assert cfg.norm_before_residual is False
    assert "vLLM would assume true" in caplog.text


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_head_matches_a_plain_reference(norm_before_residual):
    """The head written out step by step: explicit softmax attention (GQA, transformers' RoPE), the
    residual from the fused feature (normed or raw), the SwiGLU MLP, the final norm and the head."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head = random_head(norm_before_residual=norm_before_residual)
    layer, eps = head.layers[0], head.config.rms_norm_eps
    embeds, features, positions = inputs(t=5)
    fused = features @ head.fc.weight.T
    normed = rms(fused, layer.hidden_norm.weight, eps)
    x = torch.cat([rms(embeds, layer.input_layernorm.weight, eps), normed], -1)
    attn = layer.self_attn
    q = (x @ attn.q_proj.weight.T).view(2, 5, HEADS, HEAD_DIM).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(2, 5, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(2, 5, KV_HEADS, HEAD_DIM).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(target_config())(x, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = q @ k.transpose(-1, -2) / HEAD_DIM**0.5
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, HEADS * HEAD_DIM) @ attn.o_proj.weight.T
    h = (normed if norm_before_residual else fused) + mixed
    mlp = layer.mlp
    gate = torch.nn.functional.silu(
        rms(h, layer.post_attention_layernorm.weight, eps) @ mlp.gate_proj.weight.T
    )
    up = rms(h, layer.post_attention_layernorm.weight, eps) @ mlp.up_proj.weight.T
    h = h + (gate * up) @ mlp.down_proj.weight.T
    logits, hidden = head(embeds, features, positions)
    reduction = eagle3_reduction(head.config, 5)  # the head's kernels against these by-hand sums
    torch.testing.assert_close(hidden, h, **kernel_tolerance(torch.float32, reduction, float(h.abs().max())))
    want = rms(h, head.norm.weight, eps) @ head.lm_head.weight.T
    torch.testing.assert_close(
        logits, want, **kernel_tolerance(torch.float32, reduction, float(want.abs().max()))
    )


def test_bf16_head_round_trips_in_its_dtype(tmp_path):
    head = random_head(norm_before_residual=False).to(torch.bfloat16)
    out = save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target")
    loaded, _ = load_eagle3(out / "sglang")
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.d2t.dtype == torch.int64
    embeds, features, positions = (x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs())
    assert torch.equal(loaded(embeds, features, positions)[0], head(embeds, features, positions)[0])


def test_contradicting_vocabulary_maps_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    out = saved(tmp_path)
    state = load_file(str(out / "model.safetensors"))
    state["t2d"][4] = True  # a target id the draft vocabulary does not have
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(Eagle3FileError, match="d2t and t2d describe different draft vocabularies"):
        load_eagle3(out)


# --------------------------------------------------------------------------------------------------------
# Feature ids, the one default of norm_before_residual, what the engines cannot run
def test_feature_ids_are_the_inputs_of_the_target_blocks():
    """Id i is hidden_states[i], the residual stream entering block i: [0, L - 1]. L (after the last block:
    post-norm in Hugging Face and fastdecode's capture, pre-norm in vLLM, absent in SGLang) is refused by
    name with the range, in one line, from the target's config alone; 0 (the embedding output) is a head's."""
    with pytest.raises(Eagle3ConfigError) as err:
        Eagle3Config.from_target(target_config(), draft_vocab_size=DRAFT, aux_layer_ids=[2, 4, 8])
    assert str(err.value) == (
        "aux_layer_ids=[2, 4, 8]: [8] out of range; a target of 8 layers has feature ids in [0, 7] "
        "(hidden_states[i], the residual stream entering block i)"
    )
    cfg = Eagle3Config.from_target(target_config(), draft_vocab_size=DRAFT, aux_layer_ids=[0, 4, 7])
    assert cfg.aux_layer_ids == [0, 4, 7]
    with pytest.raises(Eagle3ConfigError, match=r"aux_layer_ids=\[-1, 4, 7\]: .* in \[0, L - 1\]") as err:
        dataclasses.replace(cfg, aux_layer_ids=[-1, 4, 7])  # a file's ids: no target to bound them above
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("ids", [[0, 4, 5], [2, 4, 8]])
def test_training_takes_ids_1_to_l_minus_1(ids):
    from eagle3_train.config import Eagle3RecipeConfig

    with pytest.raises(UserError, match=rf"recipe.aux_layer_ids=\[{ids[0]}, 4, {ids[2]}\] .* in \[1, 7\]"):
        Eagle3RecipeConfig(aux_layer_ids=ids).aux_layers(8)
    assert Eagle3RecipeConfig(aux_layer_ids=[7, 1, 4]).aux_layers(8) == [1, 4, 7]


def test_one_default_for_norm_before_residual(tmp_path):
    """Built without it, a head and a training run get the same layer: the one both engines serve."""
    from eagle3_train.config import Eagle3RecipeConfig

    head_cfg = Eagle3Config.from_target(target_config(), draft_vocab_size=DRAFT)
    assert Eagle3RecipeConfig().norm_before_residual is head_cfg.norm_before_residual is False
    out = save_eagle3(Eagle3Head(head_cfg), head_cfg, tmp_path / "head", verifier_name="org/target")
    assert (out / "sglang" / "config.json").is_file()


@pytest.mark.parametrize("option", ["fc_norm", "norm_before_fc"])
def test_options_no_engine_runs_are_written_with_a_warning_saying_so(tmp_path, caplog, option):
    head = random_head(**{option: True})
    with caplog.at_level(logging.WARNING, logger="fastdecode.drafters.eagle3.files"):
        out = save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target")
    assert (out / "config.json").is_file() and not (out / "sglang").exists()
    assert f"vLLM and SGLang cannot run {option}=true" in caplog.text
    assert "only fastdecode decodes it correctly" in caplog.text and "vLLM serves" not in caplog.text


def test_a_head_vllm_serves_warns_only_of_sglang(tmp_path, caplog):
    head = random_head(norm_before_residual=True)  # vLLM honours the key; SGLang has only the raw residual
    with caplog.at_level(logging.WARNING, logger="fastdecode.drafters.eagle3.files"):
        save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target")
    assert "SGLang's LlamaForCausalLMEagle3 cannot serve norm_before_residual=true" in caplog.text
    assert "cannot run" not in caplog.text
