"""The DFlash drafter's shape (``model.py``), network (``layer.py``) and files (``files.py``).

The network is checked against an independent re-implementation of the reference layer (z-lab
``dflash/model.py``: q/k RMSNorm per head before RoPE, keys and values ``cat(context, block)``, no causal mask)
written here from Hugging Face's Qwen3 modules, and its multi-block training forward against each block run
alone. The files are checked key by key against what vLLM, SGLang, speculators and llama.cpp's converter read.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from fastdecode.drafters.dflash.files import (
    CONFIG_FILE,
    SPECULATORS_DIR,
    WEIGHTS_FILE,
    DFlashFileError,
    Verifier,
    capture_layer_ids,
    load_dflash,
    read_dflash_config,
    reference_layer_ids,
    save_dflash,
)
from fastdecode.drafters.dflash.layer import DFlashDraft, block_mask
from fastdecode.drafters.dflash.model import (
    DFlashConfig,
    DFlashConfigError,
    build_target_layer_ids,
    check_target_layer_ids,
    choose_mask_token,
)

SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=100,
    target_layer_ids=[1, 3],
    num_target_layers=6,
    mask_token_id=99,
    block_size=4,
    rope_theta=500.0,
    rms_norm_eps=1e-5,
    target_architectures=["LlamaForCausalLM"],
)


def small_config(**overrides) -> DFlashConfig:
    return DFlashConfig(**{**SMALL, **overrides})


def make_draft(seed: int = 0, **overrides) -> DFlashDraft:
    """A drafter with every parameter random, norms included (ones would hide a norm applied wrongly)."""
    torch.manual_seed(seed)
    draft = DFlashDraft(small_config(**overrides))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return draft.eval()


# ---------------------------------------------------------------------------------------------------------
# model.py: target layers and the mask token


@pytest.mark.parametrize(
    ("layers", "count", "ids"),
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-4B/8B, the reference drafts
        (24, 5, [1, 6, 11, 16, 21]),  # Qwen2.5-0.5B
        (30, 5, [1, 8, 14, 20, 27]),  # SmolLM2-135M: 7.5 -> 8 and 20.5 -> 20 (Python's rounding)
        (28, 5, [1, 7, 13, 19, 25]),
        (30, 1, [15]),
        (4, 2, [1, 1]),
    ],
)
def test_build_target_layer_ids_follows_the_reference_rule(layers, count, ids):
    assert build_target_layer_ids(layers, count) == ids


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_build_target_layer_ids_refuses_a_target_too_shallow(layers):
    with pytest.raises(DFlashConfigError, match="target_layer_ids"):
        build_target_layer_ids(layers, 2)


@pytest.mark.parametrize("ids", [[1, 5], [3, 1], [1, 1], [-1, 2], []])
def test_check_target_layer_ids_refuses_the_last_layer_disorder_and_negatives(ids):
    with pytest.raises(DFlashConfigError, match="target_layer_ids"):
        check_target_layer_ids(ids, 6)
    check_target_layer_ids([0, 4], 6)


def test_feature_ids_are_the_hidden_states_indices_engines_capture():
    cfg = small_config()
    assert cfg.feature_ids == [2, 4] == capture_layer_ids(cfg.target_layer_ids)
    assert cfg.features_width == 2 * 64


def test_from_target_reads_each_familys_mlp_width():
    from transformers import LlamaConfig, OPTConfig

    llama = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4)
    opt = OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=6, num_attention_heads=4)
    assert DFlashConfig.from_target(llama, mask_token_id=0).intermediate_size == 96
    assert DFlashConfig.from_target(opt, mask_token_id=0).intermediate_size == 128
    assert DFlashConfig.from_target(opt, mask_token_id=0, intermediate_size=32).intermediate_size == 32


def test_a_mask_token_outside_the_embedding_is_refused():
    with pytest.raises(DFlashConfigError, match="mask_token_id=100"):
        small_config(mask_token_id=100)


class FakeTokenizer:
    """What ``choose_mask_token`` reads of a tokenizer."""

    def __init__(self, size: int, mask=None, added=None, template: str = "", eos: int = 2) -> None:
        self.size, self.mask_token_id, self.chat_template = size, mask, template
        self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id = 1, eos, eos, None
        self.added_tokens_decoder = {i: Token(text) for i, text in (added or {}).items()}

    def __len__(self) -> int:
        return self.size


class Token:
    def __init__(self, text: str) -> None:
        self.text, self.special = text, True

    def __str__(self) -> str:
        return self.text


SPECIALS = {1: "<s>", 2: "<|im_end|>", 3: "<|im_start|>", 4: "<repo_name>", 5: "<file_sep>"}


def test_choose_mask_token_takes_the_given_id_first():
    assert choose_mask_token(FakeTokenizer(100, mask=7), 100, explicit=42) == (42, "given")
    with pytest.raises(DFlashConfigError, match="mask_token_id=100"):
        choose_mask_token(FakeTokenizer(100), 100, explicit=100)


def test_choose_mask_token_then_the_tokenizers_mask_token():
    assert choose_mask_token(FakeTokenizer(90, mask=7), 100) == (7, "the tokenizer's mask token")


def test_choose_mask_token_then_a_spare_embedding_row():
    token, why = choose_mask_token(FakeTokenizer(90, added=SPECIALS), 100)
    assert token == 90 and "spare" in why


def test_choose_mask_token_then_a_special_token_no_text_holds():
    template = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    token, why = choose_mask_token(FakeTokenizer(100, added=SPECIALS, template=template), 100)
    assert token == 4 and "<repo_name>" in why  # not BOS/EOS/PAD, not in the chat template


def test_choose_mask_token_refuses_naming_the_setting():
    template = "<|im_start|><repo_name><file_sep>"
    with pytest.raises(DFlashConfigError, match="recipe.mask_token_id"):
        choose_mask_token(FakeTokenizer(100, added=SPECIALS, template=template), 100)


# ---------------------------------------------------------------------------------------------------------
# layer.py: the network against the reference layer


def reference_rope(positions: torch.Tensor, cfg: DFlashConfig) -> tuple[torch.Tensor, torch.Tensor]:
    qwen = Qwen3Config(head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, hidden_size=cfg.hidden_size,
                       num_attention_heads=cfg.num_attention_heads)  # fmt: skip
    qwen.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    cos, sin = Qwen3RotaryEmbedding(qwen)(torch.zeros(1, dtype=torch.float32), positions)
    return cos[:, None], sin[:, None]  # [B, 1, T, D]


class ReferenceDFlash(nn.Module):
    """The reference drafter's math, from Hugging Face's Qwen3 modules: the context ``hidden_norm(fc(f))``
    enters every layer's k/v projections unnormed; keys ``k_norm(cat(k_proj(ctx), k_proj(x)))`` then RoPE over
    the context's and the block's positions, queries ``q_norm(q_proj(x))`` then RoPE over the block's;
    softmax attention with no mask; pre-norm residual blocks; a final norm."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        qwen = Qwen3Config(
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, hidden_act="silu"
        )
        h, d, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
        self.fc = nn.Linear(cfg.features_width, h, bias=False)
        self.hidden_norm, self.norm = Qwen3RMSNorm(h, eps), Qwen3RMSNorm(h, eps)
        self.layers = nn.ModuleList()
        for _ in range(cfg.num_hidden_layers):
            layer = nn.Module()
            layer.input_layernorm, layer.post_attention_layernorm = Qwen3RMSNorm(h, eps), Qwen3RMSNorm(h, eps)
            layer.mlp = Qwen3MLP(qwen)
            attn = layer.self_attn = nn.Module()
            attn.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
            attn.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
            attn.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
            attn.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
            attn.q_norm, attn.k_norm = Qwen3RMSNorm(d, eps), Qwen3RMSNorm(d, eps)
            self.layers.append(layer)

    def attention(self, attn, x, ctx, cos, sin):
        cfg, (b, q_len, _), s = self.cfg, x.shape, ctx.shape[1]
        d, heads, groups = (
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_attention_heads // cfg.num_key_value_heads,
        )
        q = attn.q_norm(attn.q_proj(x).view(b, q_len, heads, d)).transpose(1, 2)
        k = attn.k_norm(torch.cat([attn.k_proj(ctx), attn.k_proj(x)], 1).view(b, s + q_len, -1, d)).transpose(
            1, 2
        )
        v = torch.cat([attn.v_proj(ctx), attn.v_proj(x)], 1).view(b, s + q_len, -1, d).transpose(1, 2)
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
        return attn.o_proj((weights @ v).transpose(1, 2).reshape(b, q_len, heads * d))

    def forward(self, noise, features, position_ids):
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = reference_rope(position_ids, self.cfg)
        h = noise
        for layer in self.layers:
            h = h + self.attention(layer.self_attn, layer.input_layernorm(h), ctx, cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


def inputs(cfg: DFlashConfig, context: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(1, context, cfg.features_width, generator=g)
    noise = torch.randn(1, cfg.block_size, cfg.hidden_size, generator=g)
    return features, noise


@torch.no_grad()
def test_the_drafter_computes_the_reference_layer():
    draft = make_draft()
    cfg = draft.config
    reference = ReferenceDFlash(cfg)
    reference.load_state_dict(draft.state_dict())  # the reference checkpoint's parameter names
    features, noise = inputs(cfg, context=7)
    ctx_pos, block_pos = torch.arange(7)[None], (7 + torch.arange(cfg.block_size))[None]
    ours = draft(noise, block_pos, draft.context_kv(features, ctx_pos))
    theirs = reference(noise, features, torch.cat([ctx_pos, block_pos], 1))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_context_kv_is_each_layers_projection_of_the_fused_context():
    draft = make_draft()
    cfg = draft.config
    features, _ = inputs(cfg, context=5)
    positions = torch.arange(5)[None] + 3
    ctx = F.rms_norm(
        features @ draft.fc.weight.T, (cfg.hidden_size,), draft.hidden_norm.weight, cfg.rms_norm_eps
    )
    cos, sin = reference_rope(positions, cfg)
    for layer, (k, v) in zip(draft.layers, draft.context_kv(features, positions), strict=True):
        attn = layer.self_attn
        raw_k = (ctx @ attn.k_proj.weight.T).view(1, 5, cfg.num_key_value_heads, cfg.head_dim)
        normed = F.rms_norm(raw_k, (cfg.head_dim,), attn.k_norm.weight, cfg.rms_norm_eps).transpose(1, 2)
        torch.testing.assert_close(k, normed * cos + rotate_half(normed) * sin, rtol=1e-5, atol=1e-5)
        expected_v = (ctx @ attn.v_proj.weight.T).view(1, 5, cfg.num_key_value_heads, cfg.head_dim)
        torch.testing.assert_close(v, expected_v.transpose(1, 2), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_attention_inside_a_block_is_not_causal():
    draft = make_draft()
    cfg = draft.config
    features, noise = inputs(cfg, context=6)
    ctx, pos = draft.context_kv(features, torch.arange(6)[None]), (6 + torch.arange(cfg.block_size))[None]
    changed = noise.clone()
    changed[:, -1] += 1.0  # the last slot's input only
    before, after = draft(noise, pos, ctx), draft(changed, pos, ctx)
    assert not torch.allclose(before[:, 0], after[:, 0], atol=1e-4)  # the anchor's slot sees the last one


@torch.no_grad()
def test_the_multi_block_forward_equals_each_block_alone_over_its_own_context():
    """Training's one forward over every block (``block_mask``) gives each block what decoding gives it:
    the context strictly before its anchor, itself both ways; a padded block changes nothing."""
    draft = make_draft()
    cfg, size, seq = draft.config, draft.config.block_size, 12
    features, _ = inputs(cfg, context=seq)
    anchors, keep = torch.tensor([[2, 5, 9, 0]]), torch.tensor([[True, True, True, False]])
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(1, 4 * size, cfg.hidden_size, generator=g)
    positions = (anchors[..., None] + torch.arange(size)).reshape(1, -1)
    mask = block_mask(anchors, keep, seq, size)
    together = draft(noise, positions, draft.context_kv(features, torch.arange(seq)[None]), mask)
    for n, anchor in enumerate(anchors[0, :3].tolist()):
        rows = slice(n * size, (n + 1) * size)
        context = draft.context_kv(features[:, :anchor], torch.arange(anchor)[None])
        alone = draft(noise[:, rows], positions[:, rows], context)
        torch.testing.assert_close(together[:, rows], alone, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# files.py: both formats, the engines' keys, refusals


def verifier(cfg: DFlashConfig) -> Verifier:
    torch.manual_seed(7)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    return Verifier("org/target", embed, embed.clone() * 2, ["LlamaForCausalLM"])


@pytest.fixture
def saved(tmp_path):
    draft = make_draft()
    save_dflash(draft, tmp_path / "draft", speculators=verifier(draft.config))
    return draft, tmp_path / "draft"


def read_json(path):
    return json.loads((path / CONFIG_FILE).read_text())


def test_layer_id_conversions_are_the_engines_conventions():
    assert capture_layer_ids([1, 9, 17, 25, 33]) == [2, 10, 18, 26, 34]  # llama.cpp's dflash.target_layers
    assert reference_layer_ids([2, 10, 18, 26, 34]) == [1, 9, 17, 25, 33]
    assert reference_layer_ids(capture_layer_ids([0, 4])) == [0, 4]


@pytest.mark.parametrize("sub", ["", SPECULATORS_DIR])
def test_both_formats_load_back_equal(saved, sub):
    draft, folder = saved
    loaded, cfg = load_dflash(folder / sub)
    assert cfg == draft.config and read_dflash_config(folder / sub) == cfg
    ours, theirs = draft.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_native_config_holds_what_the_engines_read(saved):
    draft, folder = saved
    config = read_json(folder)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == config["dflash_config"]["block_size"] == 4
    assert config["dflash_config"]["mask_token_id"] == 99
    assert config["dflash_config"]["target_layer_ids"] == [
        1,
        3,
    ]  # reference ids: SGLang and llama.cpp's converter
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4]  # vLLM's, used verbatim
    assert config["num_target_layers"] == 6 and config["num_hidden_layers"] == 2
    assert config["rope_theta"] == 500.0 and "rope_scaling" in config and config["rope_scaling"] is None
    assert config["layer_types"] == ["full_attention"] * 2 and config["hidden_act"] == "silu"
    assert config["vocab_size"] == 100 and config["target_hidden_size"] == 64
    assert set(load_file(str(folder / WEIGHTS_FILE))) == set(draft.state_dict())  # no embedding, no head


def test_the_speculators_config_holds_what_vllm_and_speculators_read(saved):
    draft, folder = saved
    config = read_json(folder / SPECULATORS_DIR)
    assert config["architectures"] == ["DFlashSpeculator"] and config["speculators_model_type"] == "dflash"
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["rope_theta"] == 500.0
    assert config["aux_hidden_state_layer_ids"] == [2, 4]  # vLLM's update_dflash maps back with - 1
    assert config["draft_vocab_size"] == 100 and config["block_size"] == 4 and config["mask_token_id"] == 99
    assert config["sliding_window_non_causal"] is True and config["sample_from_anchor"] is False
    spec = config["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["verifier"] == {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
    state = load_file(str(folder / SPECULATORS_DIR / WEIGHTS_FILE))
    expected = verifier(draft.config)
    assert torch.equal(state["embed_tokens.weight"], expected.embed_tokens)
    assert torch.equal(state["lm_head.weight"], expected.lm_head)


def test_save_refuses_a_verifier_of_another_shape(tmp_path):
    draft = make_draft()
    wrong = Verifier("t", torch.zeros(100, 32), torch.zeros(100, 32))
    with pytest.raises(Exception, match="embed_tokens"):
        save_dflash(draft, tmp_path / "d", speculators=wrong)
    assert not (tmp_path / "d").exists()


def test_a_reference_config_without_our_keys_is_read(tmp_path):
    """A z-lab-style directory: ``block_size`` at the top only, no vLLM ids, no fastdecode section."""
    draft = make_draft()
    folder = tmp_path / "ref"
    folder.mkdir()
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 4, "dflash_config": {"mask_token_id": 99, "target_layer_ids": [1, 3]}, "num_target_layers": 6,
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 500.0, "rope_scaling": None,
        "layer_types": ["full_attention"] * 2, "attention_bias": False, "hidden_act": "silu", "vocab_size": 100,
    }  # fmt: skip
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    save_file({f"model.{k}": v for k, v in draft.state_dict().items()}, str(folder / WEIGHTS_FILE))
    loaded, cfg = load_dflash(folder)
    assert cfg.target_layer_ids == [1, 3] and cfg.block_size == 4 and cfg.rope_theta == 500.0
    assert all(
        torch.equal(a, b)
        for a, b in zip(loaded.state_dict().values(), draft.state_dict().values(), strict=True)
    )


def test_a_speculators_checkpoint_without_the_targets_depth_is_read(saved):
    _, folder = saved
    path = folder / SPECULATORS_DIR
    config = read_json(path)
    del config["transformer_layer_config"]["num_target_layers"], config["fastdecode"]
    (path / CONFIG_FILE).write_text(json.dumps(config))
    assert read_dflash_config(path).num_target_layers == 5  # the least depth ids [1, 3] fit


def edit(folder, change) -> None:
    config = read_json(folder)
    change(config)
    (folder / CONFIG_FILE).write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("sub", "change", "named"),
    [
        ("", lambda c: c.update(architectures=["LlamaForCausalLMEagle3"]), "LlamaForCausalLMEagle3"),
        ("", lambda c: c["dflash_config"].update(target_layer_ids=[1, 5]), "target_layer_ids"),
        ("", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3]), "eagle_aux_hidden_state_layer_ids"),
        ("", lambda c: c["dflash_config"].update(mask_token_id=100), "mask_token_id=100"),
        ("", lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        ("", lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "sliding_attention"),
        ("", lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (SPECULATORS_DIR, lambda c: c.update(aux_hidden_state_layer_ids=[2, 6]), "target_layer_ids"),
        (SPECULATORS_DIR, lambda c: c.update(mask_token_id=-1), "mask_token_id=-1"),
        (SPECULATORS_DIR, lambda c: c.update(draft_vocab_size=50), "draft_vocab_size"),
        (SPECULATORS_DIR, lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
        (SPECULATORS_DIR, lambda c: c.update(speculators_model_type="eagle3"), "DFlashSpeculator"),
    ],
)
def test_a_foreign_or_inconsistent_config_is_refused_by_name(saved, sub, change, named):
    _, folder = saved
    edit(folder / sub, change)
    with pytest.raises(DFlashFileError, match=named):
        load_dflash(folder / sub)


def test_weights_that_do_not_match_the_config_are_refused_by_name(saved):
    _, folder = saved
    state = load_file(str(folder / WEIGHTS_FILE))
    state.pop("layers.1.mlp.up_proj.weight")
    state["fc.weight"] = torch.zeros(64, 3 * 64)
    save_file(state, str(folder / WEIGHTS_FILE))
    with pytest.raises(DFlashFileError, match=r"layers\.1\.mlp\.up_proj\.weight.*fc\.weight"):
        load_dflash(folder)


def test_a_missing_or_damaged_directory_is_refused_by_name(saved, tmp_path):
    _, folder = saved
    with pytest.raises(DFlashFileError, match="not a DFlash drafter"):
        read_dflash_config(tmp_path / "nowhere")
    (folder / WEIGHTS_FILE).write_bytes(b"garbage")
    with pytest.raises(DFlashFileError, match="damaged"):
        load_dflash(folder)
    (folder / CONFIG_FILE).write_text("{not json")
    with pytest.raises(DFlashFileError, match="not valid JSON"):
        read_dflash_config(folder)
