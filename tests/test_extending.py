"""The documented ways to extend fastdecode work (docs/ARCHITECTURE.md, "Where to add things"): a model family
is one registry entry plus a tiny config, a decoder one strategy function registered in ``DECODERS``, a
drafter with options its package, one line in ``fastdecode/registry.py`` and a decoder config: ``auto``
plans it, chains it, and its options reach it from a config, an override and ``generate``."""

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
from fastdecode.decoding.config import DecodeConfig, DecodeOutput, DrafterOptions
from fastdecode.decoding.kinds import Offer, PlanInputs, ProposerKind, Setup
from fastdecode.decoding.proposers import Proposer, one_hot
from fastdecode.decoding.speculative import Draft, Round
from fastdecode.registry import DECODERS, PROPOSERS
from fastdecode.runtime.families import FAMILIES, Family
from fastdecode.runtime.loading import load_model
from fastdecode.runtime.model import EarlyExitModel
from tests.conftest import ENGINES, REFERENCE
from tests.helpers import assert_drafted_and_accepted, lively_model, model_tolerance, tiny_model


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
    want = model(ids).logits  # HF's forward against EarlyExitModel's: other kernels may run
    torch.testing.assert_close(m.forward(ids), want, **model_tolerance(model.config, 21, want))
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
# A drafter with options, in 3 files: its package (options, proposer, kind: here one module, the classes
# below), one line in fastdecode/registry.py (``KINDS``), and configs/decoder/<name>.yaml.
@dataclasses.dataclass
class OracleOptions(DrafterOptions, group="oracle"):
    """``decoder.oracle``: ``tree`` drafts a token tree (the chain plus a wrong sibling of its first token);
    ``lead``: the tokens the oracle leaves out at the end of each draft (0: none)."""

    tree: bool = False
    lead: int = 0

    def __post_init__(self) -> None:
        if self.lead < 0:
            raise ConfigError(f"decoder.oracle.lead={self.lead}: need >= 0.")

    def check_call(self, m, cfg: DecodeConfig, decoder: str) -> None:
        if self.tree and cfg.chain:
            raise ConfigError("decoder.oracle.tree=true: a chain drafts chains; set decoder.chain=false.")


TREES: list[int] = []  # rows drafted as token trees, for the test to see


class OracleProposer(Proposer):
    """A toy drafter that proposes the target's own greedy continuation (recomputed from the row's whole text,
    no cache: a test oracle, never fast), deterministic, so any sampling stays lossless (q one-hot). It keeps
    no cache, so the base class serves a chain."""

    name = "oracle"

    def __init__(self, s: Setup) -> None:
        self.m, self.prompts, self.cfg, self.costs = s.m, s.prompts, s.cfg, s.costs
        self.options = OracleOptions.of(s.cfg)

    def token_cost(self) -> float:
        return 0.01  # what the plan prices it at (a real proposer measures itself, fastdecode/plan/cost.py)

    def continuation(self, r: Round, row: int) -> list[int]:
        if r.rows.finished[row] or r.limit <= self.options.lead:
            return []
        cfg = DecodeConfig(max_new_tokens=r.limit - self.options.lead, **REFERENCE)
        return DECODERS["autoregressive"](self.m, [self.prompts[row] + r.rows.tokens[row]], cfg).tokens[0]

    def propose(self, r: Round) -> Draft:
        drafts = [self.continuation(r, row) for row in range(len(self.prompts))]
        parents = None
        if self.options.tree:  # a wrong first token beside the right one, then the chain under the right one
            parents = [[-1, -1, *range(1, len(d))] if d else [] for d in drafts]
            drafts = [[d[0], (d[0] + 1) % self.m.vocab_size, *d[1:]] if d else [] for d in drafts]
            TREES.append(sum(1 for d in drafts if d))
        width = max(map(len, drafts))
        tokens = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long)
        probs = None if self.cfg.greedy else one_hot(tokens, self.m.vocab_size)
        draft = Draft(tokens, probs, [len(d) for d in drafts], sources=[self.name] * len(drafts))
        if parents is not None:
            rows = [row + [-1] * (width - len(row)) for row in parents]
            draft.parents = torch.tensor(rows, dtype=torch.long).reshape(len(rows), width)
        return draft


def oracle_offers(p: PlanInputs) -> list[Offer]:
    """What the oracle offers ``auto``: itself as a chain, priced with the acceptance its checkpoint records."""
    found = p.record.find("oracle") if p.record is not None else []
    options = {"oracle": {"tree": False, "lead": 0}}
    return [Offer("oracle", options, d.acceptance, 0.01, tokens_per_round=d.tokens_per_round) for d in found]


ORACLE = ProposerKind("oracle", OracleProposer, chainable=True, offers=oracle_offers)


@pytest.fixture
def toy_proposer(tmp_path, monkeypatch):
    """The oracle added the documented way: the registry line and its decoder config."""
    monkeypatch.setitem(PROPOSERS, "oracle", ORACLE)  # file 2: one line in fastdecode/registry.py
    configs = tmp_path / "configs"
    shutil.copytree(fastdecode.config.CONFIG_DIR, configs)
    node = {"engine": "fastdecode", "decoder": "oracle", "options": {"chain": True, "oracle": {"lead": 0}}}
    (configs / "decoder" / "oracle.yaml").write_text(yaml.safe_dump({"oracle": node}))  # file 3
    monkeypatch.setattr(fastdecode.config, "CONFIG_DIR", configs)
    return "oracle"


def oracle_checkpoint(tmp_path):
    model, tokenizer = lively_model("tiny-llama").hf, tiny_model("tiny-llama")[1]  # a model that varies
    final = tmp_path / "final"
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    record = {"format": 1, "drafters": [{"drafter": "oracle", "acceptance": 1.0}]}
    (final / "acceptance.json").write_text(json.dumps(record))
    return fastdecode.from_pretrained(str(final), device="cpu", dtype="float32")


def test_a_drafter_added_the_documented_way_is_planned_chained_and_lossless(toy_proposer, tmp_path):
    fd = oracle_checkpoint(tmp_path)
    best = fd.plan().best
    assert best.name == "prompt_lookup+oracle" and best.method == toy_proposer and best.options["chain"]
    assert best.options["oracle"] == {"tree": False, "lead": 0}
    prompts = ["Hello there", "Hi", "What is 2 + 2?"]
    fast = fd.generate(prompts, max_new_tokens=10)
    plain = fd.generate(prompts, max_new_tokens=10, method="autoregressive")
    assert fast.ids == plain.ids and fast.candidate is fd.plan(len(prompts)).best
    accepted, drafted, _ = fast.output.by_proposer["oracle"]
    assert accepted == drafted > 0  # an oracle's drafts always land, and it drafted
    assert OracleOptions.of(fast.config) == OracleOptions(tree=False, lead=0)
    sampled = fd.generate(prompts, max_new_tokens=6, method=toy_proposer, temperature=0.8, chain=False)
    assert [len(row) for row in sampled.ids] == [6, 6, 6]


def test_a_drafter_s_options_reach_it_and_its_trees_are_verified(toy_proposer, tmp_path):
    fd = oracle_checkpoint(tmp_path)
    prompts = ["Hello there", "Hi", "What is 2 + 2?"]
    plain = fd.generate(prompts, max_new_tokens=10, method="autoregressive")
    TREES.clear()
    tree = fd.generate(prompts, max_new_tokens=10, method=toy_proposer, oracle={"tree": True})
    assert tree.ids == plain.ids and sum(TREES) > 0  # token trees drafted, verified losslessly
    assert OracleOptions.of(tree.config).tree
    short = fd.generate(
        prompts, max_new_tokens=10, method=toy_proposer, oracle={"lead": 1}, policy="constant"
    )
    assert short.ids == plain.ids and OracleOptions.of(short.config).lead == 1
    with pytest.raises(ConfigError, match=r"decoder\.oracle\.lead=-1"):
        fd.generate(prompts, max_new_tokens=4, method=toy_proposer, oracle={"lead": -1})
    with pytest.raises(ConfigError, match=r"decoder\.oracle\.tree=true"):
        fd.generate(prompts, max_new_tokens=4, method=toy_proposer, oracle={"tree": True}, chain=True)
    with pytest.raises(ConfigError, match=r"decoder\.oracle\.tre"):
        to_dataclass(DecodeConfig, {"max_new_tokens": 4, "oracle": {"tre": True}}, "decoder")


def test_a_drafter_s_config_and_overrides_pass_the_benchmark_s_checks(toy_proposer):
    assert toy_proposer in group_choices("decoder")  # eval/speed.py can select it, and its checks pass
    node = yaml.safe_load((fastdecode.config.CONFIG_DIR / "decoder" / "oracle.yaml").read_text())
    spec = to_dataclass(MethodConfig, node[toy_proposer], "decoder.oracle")
    check_options(toy_proposer, spec, spec.options)
    check_options(toy_proposer, spec, spec.options | {"oracle": {"tree": False, "lead": 2}})  # an override
    with pytest.raises(ConfigError, match=r"decoder\.oracle\.options\.oracle\.leed"):
        check_options(toy_proposer, spec, spec.options | {"oracle": {"leed": 2}})
