"""Chains with suffix decoding first (``decoder.suffix.first``, ``fastdecode/decoding/chain.py``): rows draft by
suffix matching where the row text, the process's earlier outputs or a corpus match, and through the model
drafter (the exit, a draft model, an EAGLE-3 head) elsewhere. Lossless (greedy token for token, batched ragged
and alone; sampling in distribution), rows labelled by the stage that drafted them, the outputs join the
global index, and a first stage that cannot be one refused by name."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.config import ConfigError, to_dataclass
from fastdecode.decoding.config import DecodeConfig
from fastdecode.drafters.lookup.options import LookupOptions
from fastdecode.drafters.suffix.index_file import NotASuffixIndexError
from fastdecode.drafters.suffix.options import SuffixOptions
from fastdecode.drafters.suffix.proposer import SuffixProposer
from fastdecode.drafters.suffix.sources import global_index, remember, reset_global_index
from fastdecode.registry import DECODERS, PROPOSERS
from tests.eagle3_heads import head_dir
from tests.helpers import (
    assisted_target,
    draft_model,
    exact_joint,
    lively_model,
    pair_pvalues,
    random_prompts,
    tiny_vocab_model,
)
from tests.job_configs import LIVELY, tiny_speed_cfg
from tests.test_suffix_corpus import build as build_corpus

autoregressive = DECODERS["autoregressive"]
FIRST = SuffixOptions(first=True)
NEVER_RETIRED = LookupOptions(fallback_trial=0)


@pytest.fixture(autouse=True)
def empty_global_index():
    reset_global_index()
    yield
    reset_global_index()


def mixed_prompts() -> list[list[int]]:
    """Ragged random prompts: the first three answered before (``check_chain``), the last three new."""
    return random_prompts(6, seed=71)


def base_cfg(**options) -> DecodeConfig:
    fields = {"max_new_tokens": 20, "draft_tokens": 4, "costs": "estimated", "chain": True, "suffix": FIRST}
    return to_dataclass(DecodeConfig, fields | options, "test")


def check_chain(decoder: str, m, cfg: DecodeConfig, fallback: str, draft=None) -> None:
    """With the answers to half the prompts in the global index (the suffix stage drafts them), greedy
    batched and single equal autoregressive decoding; both stages drafted and had drafts accepted, and the
    rows are labelled ``suffix`` or ``fallback`` only (forced rows included)."""
    prompts = mixed_prompts()
    expected = autoregressive(m, prompts, DecodeConfig(max_new_tokens=cfg.max_new_tokens)).tokens
    remember(m, SuffixOptions.of(cfg), cfg.eos_ids, expected[:3])
    out = DECODERS[decoder](m, prompts, cfg, draft=draft) if draft else DECODERS[decoder](m, prompts, cfg)
    assert out.tokens == expected
    assert set(out.by_proposer) == {"suffix", fallback}, out.by_proposer
    assert out.by_proposer["suffix"][0] > 0 and out.by_proposer[fallback][1] > 0, out.by_proposer
    for row, prompt in enumerate(prompts):
        alone = (
            DECODERS[decoder](m, [prompt], cfg, draft=draft) if draft else DECODERS[decoder](m, [prompt], cfg)
        )
        assert alone.tokens == [expected[row]], row


@pytest.mark.parametrize("policy", ["constant", "adaptive"])
def test_suffix_before_the_exit_equals_autoregressive(policy):
    m = lively_model("tiny-llama", 0.1)
    check_chain("self_speculative", m, base_cfg(exit_layer=2, policy=policy, lookup=NEVER_RETIRED), "exit")


@pytest.mark.parametrize("policy", ["constant", "adaptive"])
def test_suffix_before_a_draft_model_equals_autoregressive(policy):
    m = assisted_target()
    cfg = base_cfg(policy=policy, lookup=NEVER_RETIRED)
    check_chain("assisted", m, cfg, "draft_model", draft=draft_model("copy"))


def test_suffix_before_an_eagle3_head_equals_autoregressive():
    m = lively_model("tiny-llama", 0.1)
    cfg = base_cfg(drafter=head_dir(m), policy="constant", draft_tokens=3, lookup=NEVER_RETIRED)
    check_chain("eagle3", m, cfg, "eagle3")


def test_the_chain_is_built_with_the_suffix_proposer_first():
    m = lively_model("tiny-llama", 0.1)
    chain = PROPOSERS["self_speculative"].proposer(m, [[1, 2, 3]], base_cfg(exit_layer=2), torch.Generator())
    assert isinstance(chain.lookup, SuffixProposer) and chain.name == "suffix+exit"
    plain = PROPOSERS["self_speculative"].proposer(
        m, [[1, 2, 3]], base_cfg(exit_layer=2, suffix=SuffixOptions()), torch.Generator()
    )
    assert plain.name == "prompt_lookup+exit"


def test_sampling_stays_lossless():
    """4000 rows of one prompt whose text repeats, 4 new tokens, the exit never retired: suffix rows draft
    deterministic tokens (q one-hot), exit rows the exit's samples; every adjacent pair's distribution matches
    the target's exactly computed one."""
    m = tiny_vocab_model()
    prompt = [3, 1, 4, 1, 5, 3, 1, 4]
    cfg = DecodeConfig(
        max_new_tokens=4, temperature=1.0, draft_tokens=3, seed=3, costs="estimated", exit_layer=1, chain=True
    ).with_options(NEVER_RETIRED, SuffixOptions(first=True, global_size=0, min_prob=0.0))
    joint = exact_joint(m, prompt, 4, cfg)
    out = DECODERS["self_speculative"](m, [prompt] * 4000, cfg)
    assert set(out.by_proposer) == {"suffix", "exit"}
    assert out.by_proposer["suffix"][1] > 100 and out.by_proposer["exit"][1] > 100, out.by_proposer
    accepted, drafted = sum(out.accepted), sum(out.drafted)
    assert accepted > 100 and drafted - accepted > 100  # both the accept and the residual paths were taken
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3


def test_the_outputs_join_the_global_index_and_are_drafted_from_again():
    """After a suffix-first chain the global index holds each row's output; the same prompts decoded again
    draft their earlier answers from it (more accepted by suffix), output unchanged. A prompt-lookup chain
    adds nothing to it."""
    m = lively_model("tiny-llama", 0.1)
    prompts = random_prompts(3, seed=72)
    cfg = base_cfg(exit_layer=2, policy="constant")
    expected = autoregressive(m, prompts, DecodeConfig(max_new_tokens=20)).tokens
    DECODERS["self_speculative"](m, prompts, cfg.with_options(SuffixOptions()))
    assert len(global_index(m, FIRST, set())) == 0
    first = DECODERS["self_speculative"](m, prompts, cfg)
    assert first.tokens == expected and len(global_index(m, FIRST, set())) == len(prompts)
    again = DECODERS["self_speculative"](m, prompts, cfg)
    assert again.tokens == expected
    assert again.by_proposer["suffix"][0] > first.by_proposer.get("suffix", [0])[0] + 20, again.by_proposer


def test_a_suffix_first_stage_that_cannot_be_one_is_refused_by_name():
    m = lively_model("tiny-llama", 0.1)
    with pytest.raises(ConfigError, match=r"decoder\.suffix\.tree=true.*first stage"):
        DECODERS["self_speculative"](
            m, [[1, 2]], base_cfg(exit_layer=2, suffix=SuffixOptions(first=True, tree=True))
        )
    with pytest.raises(ConfigError, match=r"decoder\.suffix\.first=true.*decoder\.chain=true"):
        DECODERS["self_speculative"](m, [[1, 2]], base_cfg(exit_layer=2, chain=False))
    with pytest.raises(ConfigError, match=r"decoder\.suffix\.first=true.*decoder\.chain=true"):
        DECODERS["suffix"](m, [[1, 2]], base_cfg(chain=False))
    with pytest.raises(NotASuffixIndexError, match="nonexistent"):
        DECODERS["self_speculative"](
            m, [[1, 2]], base_cfg(exit_layer=2, suffix=SuffixOptions(first=True, corpus="/nonexistent.sfx"))
        )
    cfg = to_dataclass(DecodeConfig, {"max_new_tokens": 4, "suffix": {"first": True}}, "test")
    assert SuffixOptions.of(cfg).first


def test_generate_and_the_benchmark_give_the_corpus_to_a_suffix_first_chain(tmp_path, monkeypatch):
    """``generate(corpus=)`` with ``chain=True, suffix={"first": True}`` and ``eval/speed.py corpus=`` with
    the ``*_suffix_chain`` configs (``uses_corpus``): the chain's suffix stage reads the corpus, outputs exact."""
    from eval.speed import run as run_speed

    built = build_corpus(tmp_path, [{"text": "Count from 1 to 6. 1 2 3 4 5 6"}])
    fd = fastdecode.from_pretrained("tiny-llama")
    expected = fd.generate("one two", method="autoregressive", max_new_tokens=10, chat=False)
    options = {"exit_layer": 1, "chain": True, "suffix": {"first": True}, "max_new_tokens": 10}
    out = fd.generate("one two", method="self_speculative", corpus=built["output"], chat=False, **options)
    assert out.ids == expected.ids and SuffixOptions.of(out.config).corpus == built["output"]
    corpora = []
    init = SuffixProposer.__init__

    def recording_init(self, s, **kwargs):
        init(self, s, **kwargs)
        corpora.append("corpus" in self.shared)

    monkeypatch.setattr(SuffixProposer, "__init__", recording_init)
    methods = "decoder=[autoregressive,self_speculative_suffix_chain]"
    cfg = tiny_speed_cfg(
        tmp_path, methods, "exit_layer=2", "hf_baseline=null", LIVELY, f"corpus={built['output']}"
    )
    rows = {row["method"]: row for row in run_speed(cfg)["summary"]}
    assert rows["self_speculative_suffix_chain"]["match_rate"] == 1.0
    assert corpora and all(corpora)
