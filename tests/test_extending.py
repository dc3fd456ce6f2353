"""The documented ways to extend fastdecode work (docs/ARCHITECTURE.md, "Where to add things"): a model family
is one registry entry plus a tiny config, a decoder one strategy function registered in ``DECODERS``."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import yaml

import fastdecode
import fastdecode.config
from fastdecode.bench.config import MethodConfig, check_options
from fastdecode.config import ConfigError, ModelConfig, group_choices, load_group, to_dataclass
from fastdecode.decoding import DECODERS, DecodeConfig, DecodeOutput
from fastdecode.decoding.common import Rows, check, configure_engine, prefill, refuse_draft_model
from fastdecode.families import FAMILIES, Family
from fastdecode.loading import load_model
from fastdecode.model import EarlyExitModel
from tests.conftest import ENGINES, REFERENCE
from tests.helpers import assert_drafted_and_accepted


# --------------------------------------------------------------------------------------------------------
# A model family: a ``Family`` entry in fastdecode/families.py + configs/model/tiny-<family>.yaml
@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """Qwen3 (a family HF has and the registry does not), added the documented way: its ``Family`` entry and
    its tiny config in a copy of the config directory."""
    assert "qwen3" not in FAMILIES
    monkeypatch.setitem(FAMILIES, "qwen3", Family(backbone="model"))  # file 1: fastdecode/families.py
    configs = tmp_path / "configs"
    shutil.copytree(fastdecode.config.CONFIG_DIR / "model", configs / "model")
    tiny = yaml.safe_load((configs / "model" / "tiny-qwen2.yaml").read_text())
    tiny |= {"name": "tiny-qwen3", "family": "qwen3"}
    tiny["random_init"] = {k: v for k, v in tiny["random_init"].items() if "window" not in k} | {
        "head_dim": 16
    }
    (configs / "model" / "tiny-qwen3.yaml").write_text(yaml.safe_dump(tiny))  # file 2: its tiny config
    monkeypatch.setattr(fastdecode.config, "CONFIG_DIR", configs)
    return "tiny-qwen3"


@torch.no_grad()
def test_a_family_added_the_documented_way_runs_like_hf(toy_family):
    assert toy_family in [name for name in group_choices("model") if name.startswith("tiny-")]  # TINY_MODELS
    model, _ = load_model(load_group("model", toy_family, ModelConfig, dtype="float32", device="cpu"))
    m = EarlyExitModel(model)
    ids = torch.randint(5, 261, (2, 21), generator=torch.Generator().manual_seed(0))
    assert (m.forward(ids) - model(ids).logits).abs().max().item() <= 1e-5
    assert not m.lean_supported()  # q/k norms: not the lean layers' layout, so the engine copies HF's layers
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    ref = DECODERS["autoregressive"](m, prompts, DecodeConfig(max_new_tokens=6, **REFERENCE)).tokens
    for name in ("self_speculative", "prompt_lookup"):
        for engine in ("fast", "static"):
            cfg = DecodeConfig(max_new_tokens=6, exit_layer=2 if name == "self_speculative" else None)
            out = DECODERS[name](m, prompts, dataclasses.replace(cfg, **ENGINES[engine]))
            assert out.tokens == ref, (name, engine)
            assert_drafted_and_accepted(out, name, engine)


def test_a_family_missing_from_the_registry_is_refused_by_name(toy_family, monkeypatch):
    monkeypatch.delitem(FAMILIES, "qwen3")
    with pytest.raises(ConfigError, match="Unknown model family 'qwen3'"):
        load_model(load_group("model", toy_family, ModelConfig, dtype="float32", device="cpu"))


# --------------------------------------------------------------------------------------------------------
# A decoder: one file in fastdecode/decoding/ with the shared signature, registered in DECODERS
@torch.inference_mode()
def toy_greedy(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """A toy decoder written as the documented recipe says: ``check``, its own checks, ``configure_engine``,
    then the work (here plain greedy decoding, one token per step through the whole model)."""
    check(cfg, m, prompts)
    refuse_draft_model("toy_greedy", draft)
    configure_engine(m, cfg)
    state = prefill(m, prompts, max(len(p) for p in prompts) + cfg.max_new_tokens)
    rows = Rows(len(prompts), cfg)
    out = DecodeOutput(tokens=rows.tokens)
    logits, positions = state.logits, state.positions
    while True:
        token = logits.argmax(-1)  # [B]
        rows.emit_tokens(token)
        if not rows.active:
            return out
        valid = rows.active_mask(m.device)[:, None]
        logits = m.forward(token[:, None], state.cache, position_ids=positions[:, None], valid=valid)[:, -1]
        positions = positions + 1
        out.steps += 1


@pytest.fixture
def toy_decoder(monkeypatch):
    monkeypatch.setitem(
        DECODERS, "toy_greedy", toy_greedy
    )  # the registration in fastdecode/decoding/__init__.py
    return "toy_greedy"


def test_a_decoder_added_the_documented_way_runs_through_the_public_paths(toy_decoder):
    decoder = fastdecode.from_pretrained("tiny-llama")
    ours = decoder.generate(["Hello there", "Hi"], method=toy_decoder, max_new_tokens=8)
    reference = decoder.generate(["Hello there", "Hi"], method="autoregressive", max_new_tokens=8)
    assert ours.ids == reference.ids and ours.method == toy_decoder
    # eval/speed.py: a decoder/ method naming it passes the checks made before any model loads
    spec = to_dataclass(MethodConfig, {"engine": "fastdecode", "decoder": toy_decoder}, "decoder.toy")
    check_options("toy", spec, {"draft_tokens": 3})
    with pytest.raises(ConfigError, match="decoder.toy.options"):
        check_options("toy", spec, {"draft_tokenz": 3})
