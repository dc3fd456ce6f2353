"""The documented ways to extend fastdecode work (docs/ARCHITECTURE.md, "Where to add things"): a model family
is one registry entry plus a tiny config, a decoder one strategy function registered in ``DECODERS``, a
proposer its module, one line in ``PROPOSERS`` and a decoder config, and ``auto`` plans and chains it."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import yaml

import fastdecode
import fastdecode.config
from fastdecode.bench.config import MethodConfig, check_options
from fastdecode.config import ConfigError, ModelConfig, group_choices, load_group, to_dataclass
from fastdecode.decoding.common import Rows, check, configure_engine, prefill, refuse_draft_model
from fastdecode.decoding.config import DecodeConfig, DecodeOutput
from fastdecode.decoding.kinds import Offer, PlanInputs, ProposerKind, Setup
from fastdecode.decoding.proposers import Proposer, one_hot
from fastdecode.decoding.speculative import Draft, Round
from fastdecode.registry import DECODERS, PROPOSERS
from fastdecode.runtime.families import FAMILIES, Family
from fastdecode.runtime.loading import load_model
from fastdecode.runtime.model import EarlyExitModel
from tests.conftest import ENGINES, REFERENCE
from tests.helpers import assert_drafted_and_accepted, lively_model, tiny_model


# --------------------------------------------------------------------------------------------------------
# A model family: a ``Family`` entry in fastdecode/runtime/families.py + configs/model/tiny-<family>.yaml
@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """Qwen3 (a family HF has and the registry does not), added the documented way: its ``Family`` entry and
    its tiny config in a copy of the config directory."""
    assert "qwen3" not in FAMILIES
    monkeypatch.setitem(FAMILIES, "qwen3", Family(backbone="model"))  # file 1: fastdecode/runtime/families.py
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


# --------------------------------------------------------------------------------------------------------
# A proposer: its module (a Proposer and its ProposerKind), one line in PROPOSERS, configs/decoder/<name>.yaml
class OracleProposer(Proposer):
    """File 1, the proposer's module: a toy drafter that proposes the target's own greedy continuation
    (recomputed from the row's whole text, no cache: a test oracle, never fast), deterministic, so any
    sampling stays lossless (q one-hot). It keeps no cache, so the base class serves a chain."""

    name = "oracle"

    def __init__(self, s: Setup) -> None:
        self.m, self.prompts, self.cfg, self.costs = s.m, s.prompts, s.cfg, s.costs

    def token_cost(self) -> float:
        return 0.01  # what the plan prices it at (a real proposer measures itself, fastdecode/plan/cost.py)

    def propose(self, r: Round) -> Draft:
        drafts = []
        for row, prompt in enumerate(self.prompts):
            if r.rows.finished[row] or r.limit <= 0:
                drafts.append([])
                continue
            text = prompt + r.rows.tokens[row]
            cfg = DecodeConfig(max_new_tokens=r.limit, **REFERENCE)
            drafts.append(DECODERS["autoregressive"](self.m, [text], cfg).tokens[0])
        width = max(map(len, drafts))
        tokens = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long)
        probs = None if self.cfg.greedy else one_hot(tokens, self.m.vocab_size)
        return Draft(tokens, probs, [len(d) for d in drafts], sources=[self.name] * len(drafts))


def oracle_offers(p: PlanInputs) -> list[Offer]:
    """What the oracle offers ``auto``: itself, priced with the acceptance the checkpoint records for it."""
    found = p.record.find("oracle") if p.record is not None else []
    return [Offer("oracle", {}, d.acceptance, 0.01, tokens_per_round=d.tokens_per_round) for d in found]


ORACLE = ProposerKind("oracle", OracleProposer, chainable=True, offers=oracle_offers)


@pytest.fixture
def toy_proposer(tmp_path, monkeypatch):
    """The oracle added the documented way: the registry line and its decoder config."""
    monkeypatch.setitem(PROPOSERS, "oracle", ORACLE)  # file 2: one line in fastdecode/decoding/__init__.py
    configs = tmp_path / "configs"
    shutil.copytree(fastdecode.config.CONFIG_DIR, configs)
    (configs / "decoder" / "oracle.yaml").write_text(  # file 3: its decoder config (eval/speed.py)
        yaml.safe_dump({"oracle": {"engine": "fastdecode", "decoder": "oracle", "options": {"chain": True}}})
    )
    monkeypatch.setattr(fastdecode.config, "CONFIG_DIR", configs)
    return "oracle"


def test_a_proposer_added_the_documented_way_is_planned_chained_and_lossless(toy_proposer, tmp_path):
    model, tokenizer = (
        lively_model("tiny-llama").hf,
        tiny_model("tiny-llama")[1],
    )  # a model that varies its text
    final = tmp_path / "final"
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    record = {"format": 1, "drafters": [{"drafter": "oracle", "acceptance": 1.0}]}
    (final / "acceptance.json").write_text(json.dumps(record))
    fd = fastdecode.from_pretrained(str(final), device="cpu", dtype="float32")
    best = fd.plan().best
    assert best.name == "prompt_lookup+oracle" and best.method == toy_proposer and best.options["chain"]
    prompts = ["Hello there", "Hi", "What is 2 + 2?"]
    fast = fd.generate(prompts, max_new_tokens=10)
    plain = fd.generate(prompts, max_new_tokens=10, method="autoregressive")
    assert fast.ids == plain.ids and fast.candidate is fd.plan(len(prompts)).best
    accepted, drafted, _ = fast.output.by_proposer["oracle"]
    assert accepted == drafted > 0  # an oracle's drafts always land, and it drafted
    sampled = fd.generate(prompts, max_new_tokens=6, method=toy_proposer, temperature=0.8, chain=False)
    assert [len(row) for row in sampled.ids] == [6, 6, 6]
    assert toy_proposer in group_choices("decoder")  # eval/speed.py can select it, and its checks pass
    node = yaml.safe_load((fastdecode.config.CONFIG_DIR / "decoder" / "oracle.yaml").read_text())
    spec = to_dataclass(MethodConfig, node[toy_proposer], "decoder.oracle")
    check_options(toy_proposer, spec, spec.options)
