"""Draft vocabularies: frequency ranking, the file, the model's subset head, and lossless decoding with a
subset head (greedy: identical output; sampling: the target's distribution), in both speculative decoders."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from fastdecode.config import ConfigError, load_group
from fastdecode.data.config import DataConfig
from fastdecode.data.draft_vocab import build_draft_vocab, draft_vocab_from_data
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.draft_vocab import draft_vocab_ids
from fastdecode.decoding.policies import POLICIES
from fastdecode.files.draft_vocab_file import load_draft_vocab, save_draft_vocab
from fastdecode.registry import DECODERS
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.runtime.tokenizer import byte_tokenizer
from tests.conftest import ENGINES, REFERENCE, TINY_MODELS
from tests.helpers import (
    assert_drafted_and_accepted,
    assisted_target,
    draft_model,
    exact_joint,
    pair_pvalues,
    random_prompts,
    tiny_model,
    tiny_vocab_draft,
    tiny_vocab_model,
)

autoregressive = DECODERS["autoregressive"]
SPECULATIVE = {
    "self_speculative": lambda m, prompts, cfg: DECODERS["self_speculative"](
        m, prompts, replace(cfg, exit_layer=2)
    ),
    "assisted": lambda m, prompts, cfg: DECODERS["assisted"](m, prompts, cfg, draft=draft_model("copy")),
}


def _vocab_file(tmp_path, ids, name: str = "vocab.json", vocab_size: int = 261) -> str:
    return str(save_draft_vocab(tmp_path / name, torch.as_tensor(ids), vocab_size=vocab_size))


# --------------------------------------------------------------------------------------------------------
# Building, saving, loading
def test_build_draft_vocab_ranks_by_frequency():
    data = [[5, 5, 5, 7, 7, 9], [7, 9, 9, 9, 3], []]  # counts: 9 x4, 5 x3, 7 x3, 3 x1
    assert build_draft_vocab(data, 4, always=[4, 1, 4]).tolist() == [4, 1, 9, 5]  # 5 before 7: tie, id order
    assert build_draft_vocab(iter(data), 10, always=[9]).tolist() == [9, 5, 7, 3]  # only ids seen, 9 once
    with pytest.raises(ConfigError, match="size=1 is smaller than the 2 ids.*size >= 2"):
        build_draft_vocab(data, 1, always=[0, 4])


def test_draft_vocab_file_roundtrip_cache_and_errors(tmp_path):
    m = assisted_target()
    path = _vocab_file(tmp_path, [4, 9, 7])
    assert json.loads(open(path).read())["ids"] == [4, 9, 7]
    ids, vocab_size = load_draft_vocab(path)
    assert ids.tolist() == [4, 9, 7] and vocab_size == 261
    cfg = DecodeConfig(max_new_tokens=4, draft_vocab=path)
    first = draft_vocab_ids(path, m)
    assert draft_vocab_ids(path, m) is first  # one tensor per file version: the gathered head rows are reused
    _vocab_file(tmp_path, [4, 9, 7, 8])
    assert draft_vocab_ids(path, m).tolist() == [4, 9, 7, 8]  # a rewritten file is reloaded
    assert draft_vocab_ids(DecodeConfig(max_new_tokens=4).draft_vocab, m) is None
    with pytest.raises(ConfigError, match="no such file. Build one with.*draft_vocab_from_data"):
        draft_vocab_ids(str(tmp_path / "missing.json"), m)
    (tmp_path / "bad.json").write_text('{"ids": [1, 2]}')
    with pytest.raises(ConfigError, match="is not a draft vocabulary file"):
        draft_vocab_ids(str(tmp_path / "bad.json"), m)
    big = _vocab_file(tmp_path, [4, 300], name="big.json", vocab_size=320)
    with pytest.raises(
        ConfigError, match="built for a vocabulary of 320 ids.*has 261.*this model's tokenizer"
    ):
        DECODERS["self_speculative"](m, [[5, 6]], replace(cfg, exit_layer=2, draft_vocab=big))
    with pytest.raises(ValueError, match="distinct"):
        _vocab_file(tmp_path, [4, 4])


@pytest.mark.parametrize(
    "ids,vocab_size,message",
    [
        (
            [4, 261],
            261,
            r"holds the id 261, outside the vocabulary of 261 ids it was built for \(\[0, 261\)\)",
        ),
        ([4, -1], 261, r"holds the id -1, outside the vocabulary of 261 ids"),
        ([4, 7, 4], 261, r"holds an id twice; ids must be distinct"),
        ([4, 300], 300, r"holds the id 300, outside the vocabulary of 300 ids"),  # file says 300, id 300
        ([[4, 5]], 261, r"is not a draft vocabulary file \(ids is not a list of ids"),
        ([], 261, r"holds no token ids: rebuild it with this model's tokenizer"),
    ],
)
def test_a_draft_vocab_with_an_id_out_of_range_names_the_id(tmp_path, ids, vocab_size, message):
    """A file written by hand or for another tokenizer: the id that is out of range is named (not "built for
    a vocabulary of 49152 ids but the drafting model has 49152")."""
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps({"vocab_size": vocab_size, "size": len(ids), "ids": ids}))
    with pytest.raises(ConfigError, match=message):
        draft_vocab_ids(str(path), assisted_target())


def test_draft_vocab_from_data_counts_trained_tokens(tmp_path):
    rows = [{"prompt": "zzzzzzzzzzzz", "response": "aaaa bb"}] * 3 + [{"prompt": "q", "response": "ab c"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = load_group("data", "jsonl", DataConfig, path=str(tmp_path / "d.jsonl"), held_out=0)
    tok = byte_tokenizer()
    ids = draft_vocab_from_data(data, tok, size=6).tolist()
    a, b, z = (tok.encode(ch, add_special_tokens=False)[0] for ch in "abz")
    specials = sorted(set(tok.all_special_ids))
    assert sorted(ids[: len(specials)]) == specials  # EOS, BOS, pad first, however rare
    assert ids[len(specials) : len(specials) + 2] == [a, b]  # then the most frequent reply tokens
    assert z not in ids  # prompts are not drafted: their tokens do not count


# --------------------------------------------------------------------------------------------------------
# The model's subset head (EarlyExitModel.exit_logits_subset)
@pytest.mark.parametrize("name", TINY_MODELS)
def test_exit_logits_subset_equals_the_full_head_rows(name):
    m = EarlyExitModel(copy.deepcopy(tiny_model(name)[0]))
    ids = torch.randperm(m.vocab_size, generator=torch.Generator().manual_seed(0))[:50]
    hidden = torch.randn(3, 5, m.config.hidden_size)
    torch.testing.assert_close(m.exit_logits_subset(hidden, ids), m.exit_logits(hidden)[..., ids])
    with torch.no_grad():
        m.lm_head.weight.mul_(2)  # the gathered rows must follow the head's weights
    torch.testing.assert_close(m.exit_logits_subset(hidden, ids), m.exit_logits(hidden)[..., ids])


# --------------------------------------------------------------------------------------------------------
# Decoding with a subset head stays lossless
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("decoder", SPECULATIVE)
def test_greedy_with_a_draft_vocab_equals_autoregressive(decoder, tmp_path, engine):
    """A subset of the frequent tokens: identical output, every policy. A subset without any token the
    target emits: identical output, and no draft is ever accepted (drafts come from the subset only)."""
    m, run = assisted_target(), SPECULATIVE[decoder]
    prompts = random_prompts(6, seed=21)
    base = DecodeConfig(max_new_tokens=16, draft_tokens=4, **ENGINES[engine])
    ref = autoregressive(m, prompts, replace(base, **REFERENCE))
    frequent = _vocab_file(tmp_path, build_draft_vocab(ref.tokens, 60, always=[4]), "frequent.json")
    for policy in POLICIES:
        out = run(m, prompts, replace(base, policy=policy, draft_vocab=frequent))
        assert out.tokens == ref.tokens, policy
        assert 0.1 < out.acceptance_rate, policy
    emitted = {token for row in ref.tokens for token in row}
    others = [i for i in range(m.vocab_size) if i not in emitted]
    out = run(m, prompts, replace(base, draft_vocab=_vocab_file(tmp_path, others, "others.json")))
    assert out.tokens == ref.tokens and out.acceptance_rate == 0 and sum(out.drafted) > 0


@pytest.mark.parametrize("decoder", SPECULATIVE)
def test_a_draft_vocab_of_every_token_reproduces_the_drafts(decoder, tmp_path):
    """Greedy: a shuffled full vocabulary drafts exactly the same tokens (every policy); sampling: the full
    vocabulary in id order gives the same distribution, so the same seed draws the same tokens."""
    m, run = assisted_target(), SPECULATIVE[decoder]
    prompts = random_prompts(4, seed=22)
    shuffled = _vocab_file(
        tmp_path, torch.randperm(261, generator=torch.Generator().manual_seed(0)), "s.json"
    )
    for policy in POLICIES:
        cfg = DecodeConfig(max_new_tokens=16, draft_tokens=4, policy=policy)
        plain, subset = run(m, prompts, cfg), run(m, prompts, replace(cfg, draft_vocab=shuffled))
        assert (subset.tokens, subset.accepted, subset.drafted) == (
            plain.tokens,
            plain.accepted,
            plain.drafted,
        )
        assert_drafted_and_accepted(plain, policy)
    sampled = DecodeConfig(max_new_tokens=16, draft_tokens=4, temperature=1.0, top_k=20, seed=3)
    in_order = replace(sampled, draft_vocab=_vocab_file(tmp_path, torch.arange(261), "o.json"))
    assert run(m, prompts, in_order).tokens == run(m, prompts, sampled).tokens


@pytest.mark.parametrize("engine", ["hf", "packed"])
@pytest.mark.parametrize("decoder", ["self_speculative", "assisted"])
def test_sampling_with_a_draft_vocab_matches_the_target_distribution(decoder, tmp_path, engine):
    """As in tests/test_decoding.py, with a drafter restricted to 4 of the 8 tokens: the draft distribution
    q is zero outside the subset, and the output still follows the target exactly."""
    m = tiny_vocab_model()
    prompt, samples = [3, 1, 4, 1, 5], 4000
    cfg = DecodeConfig(
        max_new_tokens=4,
        temperature=1.0,
        draft_tokens=3,
        seed=4,
        draft_vocab=_vocab_file(tmp_path, [6, 0, 2, 5], vocab_size=8),
        **ENGINES[engine],
    )
    joint = exact_joint(m, prompt, 4, cfg)
    if decoder == "assisted":
        out = DECODERS["assisted"](m, [prompt] * samples, cfg, draft=tiny_vocab_draft())
    else:
        out = DECODERS["self_speculative"](m, [prompt] * samples, replace(cfg, exit_layer=1))
    assert 0.1 < out.acceptance_rate < 0.95  # both the accept and the residual paths were taken
    assert min(pair_pvalues(out.tokens, joint)) > 1e-3
