"""Real clients of the EAGLE-3 head files ``fastdecode.drafters.eagle3.files.save_eagle3`` writes.

SGLang (unit tests): the ``sglang/`` export has exactly the tensors, shapes and config SGLang's
``LlamaForCausalLMEagle3`` loads, and SGLang's layer computed from those tensors gives our logits. The
expected names and routing are derived from sgl-project/sglang ``python/sglang/srt/models/llama_eagle3.py``
as read at commits 03d5a7771f6082e7737a5f19cae7d1e863087013 and d737979cbd17c6162f39c1953cfa72d3d23cc0d0
(same ``load_weights`` and module names in both): parameters ``model.fc``, ``model.midlayer.*`` with fused
``qkv_proj`` (shards q, k, v) and ``gate_up_proj`` (shards 0, 1), ``model.norm``, ``lm_head`` (the
embedding itself when ``tie_word_embeddings``), ``model.embed_tokens`` (the EAGLE worker sets it from
the target); a checkpoint name is tried as is, then with ``model.``; ``d2t`` becomes ``hot_token_id =
d2t + arange``, ``t2d`` is skipped, any other unmatched name is dropped silently. Its layer takes the
residual from the raw fused feature and the final norm is fused with the residual add.

speculators (slow): the ``speculators`` package's own ``Eagle3DraftModel`` loads the directory and, from
the same target features and tokens, gives our draft logits at every training-time-test step. It runs in
its own virtual environment (speculators 0.9.0 pins transformers <= 5.19):
``bash tests/interop/make_speculators_venv.sh VENV`` then
``FASTDECODE_SPECULATORS_PYTHON=VENV/bin/python pytest -m slow tests/test_eagle3_interop.py``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_train.losses import ttt_unroll
from fastdecode.drafters.eagle3.files import (
    Eagle3FileError,
    load_eagle3,
    read_eagle3_config,
    save_eagle3,
    sglang_layer_ids,
    sglang_unsupported,
)
from fastdecode.drafters.eagle3.model import Eagle3Config, Eagle3Head, default_aux_layers
from tests.helpers import eagle3_reduction, kernel_tolerance
from tests.test_eagle3_head import DRAFT, KEPT, H, inputs, random_head, rms, target_config

STACKED = [  # SGLang's stacked_params_mapping: (param_name, shard_name, shard_id)
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


def sglang_shards(config: dict) -> dict[tuple[str, object], tuple[int, ...]]:
    """``(parameter, shard) -> shape`` of every tensor SGLang's ``LlamaForCausalLMEagle3`` fills from the
    checkpoint for ``config`` (shard None: a whole parameter); the embedding is left to the target's."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inter = config.get("head_dim") or hidden // heads, config["intermediate_size"]
    layer = "model.midlayer."
    shards = {
        ("model.fc.weight", None): (hidden, 3 * config.get("target_hidden_size", hidden)),
        (layer + "self_attn.qkv_proj.weight", "q"): (heads * head_dim, 2 * hidden),
        (layer + "self_attn.qkv_proj.weight", "k"): (kv * head_dim, 2 * hidden),
        (layer + "self_attn.qkv_proj.weight", "v"): (kv * head_dim, 2 * hidden),
        (layer + "self_attn.o_proj.weight", None): (hidden, heads * head_dim),
        (layer + "mlp.gate_up_proj.weight", 0): (inter, hidden),
        (layer + "mlp.gate_up_proj.weight", 1): (inter, hidden),
        (layer + "mlp.down_proj.weight", None): (hidden, inter),
        **{(f"{layer}{n}.weight", None): (hidden,) for n in ("input_layernorm", "hidden_norm")},
        (layer + "post_attention_layernorm.weight", None): (hidden,),
        ("model.norm.weight", None): (hidden,),
    }
    if not config["tie_word_embeddings"]:  # tied: lm_head IS model.embed_tokens, no parameter of its own
        shards["lm_head.weight", None] = (config["draft_vocab_size"] or config["vocab_size"], hidden)
    return shards


def sglang_route(name: str, params: set[str]) -> tuple[str, object] | None:
    """Where SGLang's ``load_weights`` puts checkpoint tensor ``name``: ``(parameter, shard)``, ``("d2t",
    None)`` / ``("t2d", None)``, or None when it drops it."""
    if "d2t" in name or "t2d" in name:
        return ("d2t" if "d2t" in name else "t2d"), None
    for param, weight, shard in STACKED:
        if weight in name:
            name = name.replace(weight, param)
            target = name if name in params else f"model.{name}"
            return (target, shard) if target in params else None
    target = name if name in params else f"model.{name}"
    return (target, None) if target in params else None


def sglang_load(folder: Path) -> tuple[dict, dict[tuple[str, object], torch.Tensor]]:
    """``(config, routed tensors)`` as SGLang would load ``folder``; fails on a dropped or misshapen one."""
    config = json.loads((folder / "config.json").read_text())
    expected = sglang_shards(config)
    params = {p for p, _ in expected}
    routed = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        where = sglang_route(name, params)
        assert where is not None, f"SGLang drops {name}"
        assert where not in routed, f"{name}: a second tensor for {where}"
        routed[where] = tensor
    shapes = {k: tuple(v.shape) for k, v in routed.items() if k[0] not in ("d2t", "t2d")}
    assert shapes == expected
    return config, routed


@pytest.mark.parametrize("tied_target", [False, True])
def test_sglang_export_is_what_sglang_loads(tmp_path, tied_target):
    cfg = Eagle3Config.from_target(
        target_config(tie_word_embeddings=tied_target), draft_vocab_size=DRAFT, norm_before_residual=False
    )
    head = Eagle3Head(cfg)
    head.set_draft_vocab(KEPT)
    out = save_eagle3(head, cfg, tmp_path / "head", verifier_name="org/target")
    config, routed = sglang_load(out / "sglang")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    # tie_word_embeddings true would make SGLang score with the target's embedding and drop our lm_head
    assert config["tie_word_embeddings"] is False and config["draft_vocab_size"] == DRAFT
    assert config["hidden_act"] == "silu" and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    hot = routed["d2t", None] + torch.arange(DRAFT)  # SGLang's hot_token_id
    assert hot.tolist() == head.draft_to_target(torch.arange(DRAFT)).tolist() == sorted(KEPT)


@pytest.mark.parametrize(
    "options",
    [
        {"norm_before_residual": True},
        {"fc_norm": True},
        {"norm_before_fc": True},
        {"aux_layer_ids": [0, 4, 5]},
    ],
)
def test_heads_sglang_cannot_run_are_not_exported_to_it(tmp_path, options):
    head = random_head(**options)
    assert sglang_unsupported(head.config)
    out = save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target")
    assert (out / "config.json").is_file() and not (out / "sglang").exists()


def test_a_specforge_config_without_norm_before_residual_is_read_as_sglang_runs_it(tmp_path, caplog):
    head = random_head(seed=4, norm_before_residual=False)
    out = save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target") / "sglang"
    config = json.loads((out / "config.json").read_text())
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm"):  # SpecForge writes none of them
        del config[key]
    (out / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="fastdecode.drafters.eagle3.files"):
        loaded, cfg = load_eagle3(out)
    assert cfg.norm_before_residual is False and not caplog.text  # SGLang's only layer: no doubt to warn of
    embeds, features, positions = inputs()
    assert torch.equal(loaded(embeds, features, positions)[0], head(embeds, features, positions)[0])


def sglang_captures(explicit_ids: list[int] | None, num_layers: int) -> list[int]:
    """The ``hidden_states`` index of each feature SGLang hands an EAGLE-3 head, in the order it concatenates
    them: a transcription of sgl-project/sglang ``python/sglang/srt/models/llama.py``.
    ``set_eagle3_layers_to_capture(layer_ids)`` sets ``layers_to_capture = [val + 1 for val in layer_ids]``
    ("for the ith layer, it takes the output of the (i-1)th layer"), or ``[2, L // 2, L - 3]`` without ids;
    ``LlamaModel.forward`` runs ``for i in range(start_layer, end_layer)``, appending ``hidden_states +
    residual`` (the residual stream entering layer i: ``hidden_states[i]``) when ``i in layers_to_capture``,
    then layer i; the residual is None before layer 0, where the addition fails (TypeError here)."""
    to_capture = (
        [val + 1 for val in explicit_ids] if explicit_ids is not None else default_aux_layers(num_layers)
    )
    captured, residual = [], None
    for i in range(num_layers):
        if i in to_capture:
            if residual is None:
                raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")
            captured.append(i)
        residual = "the residual stream"  # every layer returns one
    return captured


@pytest.mark.parametrize("aux", [None, [1, 4, 7], [1, 2, 3], [3, 5, 6]])
def test_sglang_captures_the_features_the_head_reads(tmp_path, aux):
    """The ``sglang/`` ids make SGLang capture exactly ``hidden_states[aux]``; the speculators dialect keeps
    them (vLLM uses them unchanged); either folder reads back the head's ids."""
    head = random_head(aux_layer_ids=aux)  # a target of 8 layers; None: [2, 4, 5]
    aux = head.config.aux_layer_ids
    out = save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target")
    sglang = json.loads((out / "sglang" / "config.json").read_text())
    assert sglang_captures(sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"], 8) == aux
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == aux
    for folder in (out, out / "sglang"):
        assert read_eagle3_config(folder).aux_layer_ids == load_eagle3(folder)[1].aux_layer_ids == aux


@pytest.mark.parametrize("layers", [8, 28, 32])
def test_specforge_default_ids_import_as_what_sglang_captures(tmp_path, layers):
    """SpecForge writes ``[1, L // 2 - 1, L - 4]`` (SGLang's own default features): ours ``[2, L // 2, L - 3]``."""
    specforge = [1, layers // 2 - 1, layers - 4]
    assert sglang_captures(specforge, layers) == sglang_captures(None, layers) == default_aux_layers(layers)
    head = random_head()
    out = save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target") / "sglang"
    config = json.loads((out / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = specforge
    (out / "config.json").write_text(json.dumps(config))
    assert read_eagle3_config(out).aux_layer_ids == [2, layers // 2, layers - 3]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [-2, 3, 4]  # ours -1: refused by name
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(Eagle3FileError, match=r"aux_layer_ids=\[-1, 4, 5\]"):
        read_eagle3_config(out)


def test_feature_id_0_is_kept_for_vllm_and_not_exported_to_sglang(tmp_path, caplog):
    """The embedding output: vLLM and fastdecode capture it; SGLang would need id -1 and fails on it."""
    head = random_head(aux_layer_ids=[0, 4, 5])
    with pytest.raises(TypeError):
        sglang_captures(sglang_layer_ids([0, 4, 5]), 8)
    with caplog.at_level(logging.WARNING, logger="fastdecode.drafters.eagle3.files"):
        out = save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target")
    assert not (out / "sglang").exists() and "feature id 0 (the embedding output)" in caplog.text
    assert load_eagle3(out)[1].aux_layer_ids == [0, 4, 5]


def sglang_forward(routed: dict, config: dict, embeds: torch.Tensor, features: torch.Tensor, positions):
    """SGLang's ``LlamaModel.forward`` of ``llama_eagle3.py`` (one sequence per row, causal attention) on
    the routed tensors -> draft logits ``[B, T, draft_vocab_size]``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    w = {(k[0].removeprefix("model.").removeprefix("midlayer."), k[1]): v for k, v in routed.items()}
    eps, heads, kv, hd = (
        config[k] for k in ("rms_norm_eps", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    b, t, _ = embeds.shape
    hidden = features @ w["fc.weight", None].T
    residual = hidden  # SGLang: the raw fused feature
    x = torch.cat(
        [
            rms(embeds, w["input_layernorm.weight", None], eps),
            rms(hidden, w["hidden_norm.weight", None], eps),
        ],
        -1,
    )
    qkv = x @ torch.cat([w["self_attn.qkv_proj.weight", s] for s in "qkv"]).T
    q, k, v = qkv.split([heads * hd, kv * hd, kv * hd], -1)
    q, k, v = (y.view(b, t, -1, hd).transpose(1, 2) for y in (q, k, v))
    cos, sin = LlamaRotaryEmbedding(LlamaConfig(**config))(x, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    h = attn.transpose(1, 2).reshape(b, t, heads * hd) @ w["self_attn.o_proj.weight", None].T
    residual = h + residual  # post_attention_layernorm(h, residual): fused add, then norm
    gate, up = (
        rms(residual, w["post_attention_layernorm.weight", None], eps) @ w["mlp.gate_up_proj.weight", i].T
        for i in (0, 1)
    )
    h = (F.silu(gate) * up) @ w["mlp.down_proj.weight", None].T
    return rms(h + residual, w["norm.weight", None], eps) @ w["lm_head.weight", None].T


def test_sglang_computes_our_logits_from_the_export(tmp_path):
    head = random_head(seed=3, norm_before_residual=False)
    out = save_eagle3(head, head.config, tmp_path / "head", verifier_name="org/target")
    config, routed = sglang_load(out / "sglang")
    embeds, features, positions = inputs()
    expected, _ = head(embeds, features, positions)
    got = sglang_forward(routed, config, embeds, features, positions)
    # SGLang's fused projections (qkv, gate_up) by hand against our head's: one step over 6 keys
    tol = kernel_tolerance(torch.float32, eagle3_reduction(head.config, 6), float(expected.abs().max()))
    torch.testing.assert_close(got, expected, **tol)


SPECULATORS_PYTHON = "FASTDECODE_SPECULATORS_PYTHON"
INTEROP = Path(__file__).resolve().parent / "interop"
CASES = {  # name: (seed, head options, the target ties its embedding)
    "normed_residual": (0, {"norm_before_residual": True}, False),
    "plain": (1, {}, True),
    "fc_norm": (2, {"fc_norm": True, "norm_before_residual": True}, False),
    "norm_before_fc": (3, {"norm_before_fc": True}, True),
}
LENGTH, STEPS = 128, 3  # speculators extends its flex-attention block mask per step: T a multiple of 128


def write_case(case: Path, seed: int, options: dict, tied: bool) -> list[torch.Tensor]:
    """A random target and head saved under ``case`` with random inputs -> our logits per TTT step."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(target_config(tie_word_embeddings=tied)).eval()
    target.save_pretrained(case / "target")
    head = random_head(seed, **options)
    save_eagle3(
        head, head.config, case / "head", verifier_name=str(case / "target"), speculative_tokens=STEPS
    )
    gen = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(0, target.config.vocab_size, (1, LENGTH), generator=gen)
    features = torch.randn(1, LENGTH, 3 * H, generator=gen)
    positions = torch.arange(LENGTH)[None] + 1 + seed  # speculators' shifted positions start at 1
    batch = {"hidden_states": features, "input_ids": ids, "position_ids": positions}
    torch.save({**batch, "document_ids": torch.zeros_like(ids), "ttt_steps": STEPS}, case / "inputs.pt")
    with torch.no_grad():
        embeds = target.get_input_embeddings()(ids)
        return ttt_unroll(head, embeds, features, positions, steps=STEPS)


@pytest.mark.slow
def test_speculators_computes_our_draft_logits(tmp_path):
    python = os.environ.get(SPECULATORS_PYTHON)
    if not python or not Path(python).is_file():
        pytest.skip(
            f"{SPECULATORS_PYTHON} does not name a Python with speculators 0.9.0: create one with "
            "`bash tests/interop/make_speculators_venv.sh VENV` and set "
            f"{SPECULATORS_PYTHON}=VENV/bin/python"
        )
    ours = {name: write_case(tmp_path / name, *case) for name, case in CASES.items()}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the venv's own packages, not ours
    run = subprocess.run(
        [python, str(INTEROP / "speculators_check.py"), *(str(tmp_path / n) for n in CASES)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    for name, logits in ours.items():
        theirs = torch.load(tmp_path / name / "speculators.pt")["logits"]
        assert len(theirs) == STEPS
        config = random_head(CASES[name][0], **CASES[name][1]).config
        for step, (a, b) in enumerate(zip(logits, theirs, strict=True)):
            # step k feeds the token k rows ahead: the last k rows run past the sequence (speculators pads
            # with token 0, we with a zero embedding), are excluded from both losses, and are not compared
            rows = LENGTH - step
            # another library's kernels: step k chains k + 1 head steps over the sequence and the chain
            reduction = (step + 1) * eagle3_reduction(config, LENGTH + step)
            tol = kernel_tolerance(torch.float32, reduction, float(a[:, :rows].abs().max()))
            torch.testing.assert_close(
                b[:, :rows].to(a.dtype),
                a[:, :rows],
                **tol,
                msg=lambda m, n=name, k=step: f"{n}, TTT step {k}: {m}",
            )
