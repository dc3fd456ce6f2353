"""The library API (fastdecode/api.py): the README's example, inputs of every form, HF aliases, streaming, and the
decoding defaults a checkpoint directory records (exit, draft vocabulary), and the SkipDecode policy it was
trained with, which decoding keeps to."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import fastdecode
from fastdecode.checkpoint_info import write_sidecar
from fastdecode.config import ConfigError
from fastdecode.decoding import DECODERS
from fastdecode.draft_vocab_file import save_draft_vocab
from fastdecode.skipdecode import SkipOptions, SkipPolicyMismatchError
from tests.helpers import assert_drafted_and_accepted, tiny_model

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def fd():
    model, tokenizer = tiny_model("tiny-llama")
    return fastdecode.FastDecoder(model, tokenizer)


def test_the_readme_example_runs():
    """The first python block under "## Python API", run as written: text in, text out, equal to
    autoregressive (its own assert)."""
    section = README.read_text().split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    fast, plain = scope["fast"], scope["plain"]
    assert isinstance(fast.text, str) and fast.text == plain.text and fast.ids == plain.ids
    for drafted in (fast, scope["exit2"]):  # the equality above holds with drafting off too
        assert_drafted_and_accepted(drafted.output, drafted.method)
    assert 0 <= fast.acceptance <= 1 and fast.tokens_per_verification >= 1
    assert plain.acceptance is None and plain.tokens_per_verification is None
    assert isinstance(fastdecode.__version__, str) and fastdecode.__version__


def test_every_input_form_decodes_the_same(fd):
    texts = ["Hello there", "Hi"]
    batch = fd.generate(texts, max_new_tokens=6, method="autoregressive")
    assert isinstance(batch.text, list) and len(batch.texts) == 2
    ids = [fd._encode(t, None) for t in texts]
    assert fd.generate(ids, max_new_tokens=6, method="autoregressive").ids == batch.ids
    one = fd.generate(ids[0], max_new_tokens=6, method="autoregressive")
    assert one.ids == batch.ids[:1] and one.text == batch.texts[0]
    assert fd.generate(torch.tensor(ids[0]), max_new_tokens=6, method="autoregressive").ids == one.ids
    width = max(map(len, ids))  # a tokenizer batch, left-padded: the mask drops the padding
    padded = {
        "input_ids": torch.tensor([[0] * (width - len(r)) + r for r in ids]),
        "attention_mask": torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids]),
    }
    assert fd.generate(padded, max_new_tokens=6, method="autoregressive").ids == batch.ids
    with pytest.raises(ConfigError, match="inputs must be"):
        fd.generate(3.5, max_new_tokens=2)


def test_hf_aliases_and_misspelt_options(fd):
    cfg = fd.config(
        "self_speculative",
        max_new_tokens=4,
        assistant_early_exit=3,
        num_assistant_tokens=5,
        num_assistant_tokens_schedule="heuristic",
        assistant_confidence_threshold=0.2,
    )
    assert (cfg.exit_layer, cfg.draft_tokens, cfg.policy, cfg.confidence_threshold) == (
        3,
        5,
        "heuristic",
        0.2,
    )
    assert cfg.eos_token_id == [fd.tokenizer.eos_token_id]  # EOS from the tokenizer
    with pytest.raises(ConfigError, match="Did you mean 'exit_layer'"):
        fd.config("self_speculative", max_new_tokens=4, exit_layr=2)
    with pytest.raises(ConfigError, match="same option"):
        fd.config("self_speculative", max_new_tokens=4, exit_layer=2, assistant_early_exit=2)
    with pytest.raises(ConfigError, match="records none: pass exit_layer=E"):
        fd.config("self_speculative", max_new_tokens=4)  # no checkpoint: no E to fall back on
    with pytest.raises(ConfigError, match="Unknown decoder 'self_spec'"):
        fd.config("self_spec", max_new_tokens=4)


class _Streamer:
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended = True


def test_streamer_gets_the_prompt_then_every_new_token(fd):
    streamer = _Streamer()
    out = fd.generate("Hello there", max_new_tokens=7, exit_layer=2, draft_tokens=3, streamer=streamer)
    assert streamer.puts[0] == fd._encode("Hello there", None) and streamer.ended
    assert sum(streamer.puts[1:], []) == out.ids[0] and len(out.ids[0]) == 7
    assert_drafted_and_accepted(out.output)  # accepted drafts arrive together
    with pytest.raises(ConfigError, match="streams one row"):
        fd.generate(["a", "b"], max_new_tokens=2, method="autoregressive", streamer=_Streamer())


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """tiny-llama saved as a checkpoint that records E=3, a draft vocabulary and a SkipDecode policy."""
    model, tokenizer = tiny_model("tiny-llama")
    out = tmp_path_factory.mktemp("ckpt") / "final"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_sidecar(out, recipe="layerskip", run_name="layerskip-tiny-llama", exit_layer=3)
    save_draft_vocab(
        out / "draft_vocab.json", torch.arange(40), vocab_size=model.config.vocab_size, source="t"
    )
    skip = {"max_budget": 3, "min_budget": 2, "warmup_layers": 1, "max_length": None}
    (out / "skipdecode.json").write_text(json.dumps({"skip": skip}))
    return out


def test_from_pretrained_reads_what_the_checkpoint_records(checkpoint_dir):
    fd = fastdecode.from_pretrained(str(checkpoint_dir), device="cpu", dtype="float32")
    spec = fd.config("self_speculative", max_new_tokens=4)
    assert spec.exit_layer == 3 and spec.draft_vocab == str(checkpoint_dir / "draft_vocab.json")
    assert fd.config("self_speculative", max_new_tokens=4, exit_layer=1).exit_layer == 1  # options win
    skip = fd.config("skipdecode", max_new_tokens=4).skip
    assert (skip.max_budget, skip.min_budget) == (3, 2)
    assert fd.config("autoregressive", max_new_tokens=4).exit_layer is None  # defaults are per method
    prompt = "Tell me"
    fast = fd.generate(prompt, max_new_tokens=10, method="self_speculative")  # the recorded E and vocabulary
    plain = fd.generate(prompt, max_new_tokens=10, method="autoregressive")
    assert fast.text == plain.text and fast.config.exit_layer == 3 and sum(fast.output.drafted)
    # No acceptance recorded for E: the default decodes with prompt lookup, which needs nothing recorded.
    auto = fd.generate(prompt, max_new_tokens=10)
    assert auto.method == "prompt_lookup" and auto.text == plain.text
    assert_drafted_and_accepted(auto.output)
    assert fd.plan().not_paying == [] and [c.name for c in fd.plan().candidates] == ["prompt_lookup"]


def test_skipdecode_keeps_to_the_policy_the_checkpoint_was_trained_with(checkpoint_dir, monkeypatch):
    """No options: the recorded policy; options that match it: accepted; options that contradict it: refused
    with ``SkipPolicyMismatchError`` before any decoding; ``skip_file=None``: the options alone, on purpose."""
    fd = fastdecode.from_pretrained(str(checkpoint_dir), device="cpu", dtype="float32")
    recorded = fd.generate("Tell me", max_new_tokens=5, method="skipdecode")
    assert recorded.config.skip == SkipOptions(max_budget=3, min_budget=2, warmup_layers=1)
    assert recorded.layers_per_token < fd.m.num_layers  # the trained policy skips layers
    same = fd.generate(
        "Tell me", max_new_tokens=5, method="skipdecode", skip={"max_budget": 3, "warmup_layers": 1}
    )
    assert same.config.skip == recorded.config.skip and same.ids == recorded.ids
    assert (
        fd.config("skipdecode", max_new_tokens=5, skip=SkipOptions(min_budget=2)).skip == recorded.config.skip
    )
    monkeypatch.setitem(DECODERS, "skipdecode", lambda *a, **k: pytest.fail("decoding started"))
    with pytest.raises(SkipPolicyMismatchError, match=r"skip.min_budget=1, trained with 2.*skip_file=None"):
        fd.generate("Tell me", max_new_tokens=5, method="skipdecode", skip={"min_budget": 1})
    with pytest.raises(SkipPolicyMismatchError, match=r"skip.warmup_layers=0, trained with 1"):
        fd.generate("Tell me", max_new_tokens=5, method="skipdecode", skip=SkipOptions(warmup_layers=0))
    free = fastdecode.from_pretrained(str(checkpoint_dir), device="cpu", dtype="float32", skip_file=None)
    assert free.config("skipdecode", max_new_tokens=5, skip={"min_budget": 1}).skip == SkipOptions(
        min_budget=1
    )


def test_the_default_decoder_is_what_the_checkpoint_expects_to_pay(checkpoint_dir, tmp_path):
    """With an exit report that records high acceptance at E (the LayerSkip recipe writes it), the default
    chains prompt lookup before that exit; with a poor one, the exit is named as not paying."""
    import shutil

    for agreement, expected in (({"3": 0.99}, "self_speculative"), ({"3": 0.01}, "prompt_lookup")):
        run = tmp_path / str(agreement["3"])
        shutil.copytree(checkpoint_dir, run / "final")
        report = {"after": {"generations": {"agreement": agreement}}}
        (run / "exit_report.json").write_text(json.dumps(report))
        fd = fastdecode.from_pretrained(str(run / "final"), device="cpu", dtype="float32")
        out = fd.generate("Tell me", max_new_tokens=10)
        assert out.method == expected
        assert out.text == fd.generate("Tell me", max_new_tokens=10, method="autoregressive").text
        assert_drafted_and_accepted(out.output, expected)
        if expected == "self_speculative":
            assert out.config.chain and out.config.exit_layer == 3 and "exit" in out.output.by_proposer
        else:
            assert fd.plan().not_paying[0]["exit"] == 3


def test_every_model_generates_by_default():
    """A model that records no exit or adapter still generates with the default (prompt lookup)."""
    out = fastdecode.from_pretrained("tiny-llama").generate("hello", max_new_tokens=6)
    assert out.method == "prompt_lookup" and len(out.ids[0]) == 6


def test_from_pretrained_names_what_it_cannot_load():
    with pytest.raises(ConfigError, match="neither a model directory, a hub id.*tiny-llama"):
        fastdecode.from_pretrained("no-such-model")


@pytest.mark.slow
def test_the_embedded_default_generates_by_default_with_prompt_lookup():
    """The real SmolLM2-135M records no exit: the default decodes with prompt lookup, which drafts from the
    text a rewrite request gives, and the text is the autoregressive one."""
    fd = fastdecode.from_pretrained("smollm2-135m", device="cpu", dtype="float32")
    assert fd.generate("hello", max_new_tokens=8).method == "prompt_lookup"
    prompt = (
        "Fix the spelling in this sentence and return it: The quick brwon fox jumsp over the lazy dog "
        "while the farmer watchs from the porch."
    )
    fast = fd.generate(prompt, max_new_tokens=40)
    plain = fd.generate(prompt, max_new_tokens=40, method="autoregressive")
    assert fast.text == plain.text and fast.output.by_proposer["prompt_lookup"][0] > 0
    print(f"\n{fast.text!r}: acceptance {fast.acceptance:.2f}, plan {fd.plan().to_json()}")
