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
from fastdecode.config import ConfigError
from fastdecode.drafters.suffix.options import SuffixOptions
from fastdecode.files.checkpoint_info import write_sidecar
from fastdecode.files.draft_vocab_file import save_draft_vocab
from fastdecode.registry import DECODERS
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


BAD_INPUTS = {
    "3-D tensor": (
        torch.ones(1, 1, 3, dtype=torch.long),
        r"inputs has shape \(1, 1, 3\); token ids are \[T\]",
    ),
    "0-D tensor": (torch.tensor(5), r"inputs has shape \(\); token ids are \[T\]"),
    "float tensor": (torch.tensor([1.0, 2.0]), r"inputs holds torch.float32 values; token ids are integers"),
    "float ids": ([1.0, 2.0], r"inputs must be token ids \(ints\); got float 1.0"),
    "float rows": ([[1, 2], [3.5]], r"row 1 of inputs must be token ids \(ints\); got float 3.5"),
    "nested rows": ([[[1, 2]]], r"row 0 of inputs must be token ids \(ints\); got list \[1, 2\]"),
    "no input_ids": (
        {"attention_mask": torch.ones(1, 3)},
        r"a tokenizer batch needs input_ids; got the keys",
    ),
    "mask of another shape": (
        {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 4)},
        r"attention_mask has shape \(2, 4\) but input_ids \(2, 3\)",
    ),
    "float input_ids": ({"input_ids": torch.ones(1, 3)}, r"input_ids holds torch.float32 values"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_inputs_of_another_form_are_named(fd, name, monkeypatch):
    """Every malformed input is a ConfigError naming what was given, before any decoding."""
    inputs, message = BAD_INPUTS[name]
    monkeypatch.setitem(DECODERS, "autoregressive", lambda *a, **k: pytest.fail("decoding started"))
    with pytest.raises(ConfigError, match=message):
        fd.generate(inputs, max_new_tokens=2, method="autoregressive")


def test_a_method_that_is_no_name_and_too_many_new_tokens_are_named(fd):
    with pytest.raises(ConfigError, match=r"Unknown decoder 'None'\. Choices: assisted, autoregressive"):
        fd.generate("hi", max_new_tokens=2, method=None)
    context = fd.model.config.max_position_embeddings
    message = (
        rf"max_new_tokens=1000000000 exceeds the model's context of {context} positions.*<= {context - 1}"
    )
    with pytest.raises(ConfigError, match=message):
        fd.generate("hi", max_new_tokens=10**9, method="autoregressive")
    with pytest.raises(
        ConfigError,
        match=rf"prompt 0 has \d+ tokens but the model's context .* is {context} and max_new_tokens={context - 2}",
    ):
        fd.generate("a long prompt", max_new_tokens=context - 2, method="autoregressive")


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


def test_hf_aliases_under_auto_are_the_fields_they_name():
    """``auto`` merges the plan's options with the caller's: the aliases are renamed first, so an alias is the
    field it names (was: "same option", the plan's ``draft_tokens`` against ``num_assistant_tokens``), and
    overrides the plan's value as the field does."""
    fd = fastdecode.from_pretrained("tiny-llama")
    prompts = ["Hello there", "Hi"]
    pairs = [
        ({"num_assistant_tokens": 5}, {"draft_tokens": 5}),
        ({"num_assistant_tokens_schedule": "heuristic_transient"}, {"policy": "heuristic"}),
    ]
    for alias, field in pairs:
        by_alias = fd.generate(prompts, max_new_tokens=8, **alias)
        by_field = fd.generate(prompts, max_new_tokens=8, **field)
        assert by_alias.candidate is by_field.candidate and by_alias.method == by_field.method
        assert by_alias.config == by_field.config and by_alias.ids == by_field.ids
        (name, value), planned = next(iter(field.items())), by_field.candidate.options
        assert getattr(by_alias.config, name) == value != planned[name]  # the caller's value, not the plan's
    with pytest.raises(ConfigError, match="draft_tokens and num_assistant_tokens are the same option"):
        fd.generate(prompts, max_new_tokens=8, draft_tokens=5, num_assistant_tokens=5)


def test_a_given_option_group_is_merged_into_the_checkpoints_defaults_key_by_key():
    """A checkpoint default that is an option group keeps the keys the call does not give."""
    model, tokenizer = tiny_model("tiny-llama")
    fd = fastdecode.FastDecoder(model, tokenizer)
    fd.defaults["suffix"] = {"suffix": {"max_depth": 8, "global_size": 16}}
    suffix = fd.config("suffix", max_new_tokens=4, suffix={"global_size": 0}).groups["suffix"]
    assert (suffix.max_depth, suffix.global_size) == (8, 0)
    fd.defaults["suffix"] = {"suffix": SuffixOptions(max_depth=8)}  # an options object as the default
    assert fd.config("suffix", max_new_tokens=4, suffix={"min_match": 2}).groups["suffix"] == SuffixOptions(
        max_depth=8, min_match=2
    )
    whole = fd.config("suffix", max_new_tokens=4, suffix=SuffixOptions(min_match=2)).groups["suffix"]
    assert whole == SuffixOptions(min_match=2)  # an options object given states every field


def test_eagle3_without_a_head_names_the_python_argument(fd):
    with pytest.raises(ConfigError, match=r"generate\(\.\.\., drafter=PATH\)") as caught:
        fd.generate("hi", max_new_tokens=2, method="eagle3")
    assert "from_pretrained(..., drafter=PATH)" in str(caught.value)
    assert "fastdecode.drafters" not in str(caught.value)  # no module path a user cannot run


def test_from_pretrained_takes_a_dflash_drafter_as_the_dflash_methods_default(tmp_path):
    """``from_pretrained(drafter=PATH)`` tells a DFlash directory from an EAGLE-3 head by its config: it is
    ``method="dflash"``'s default (lossless), and ``eagle3`` still asks for its own head."""
    from tests.dflash_drafters import random_drafter_dir

    fast = fastdecode.from_pretrained("tiny-llama", device="cpu", drafter=random_drafter_dir(tmp_path))
    plain = fast.generate("Count to five", max_new_tokens=8, method="autoregressive")
    out = fast.generate("Count to five", max_new_tokens=8, method="dflash", costs="estimated")
    assert out.ids == plain.ids and out.method == "dflash" and sum(out.output.drafted) > 0
    with pytest.raises(ConfigError, match="decoder 'dflash' needs decoder.drafter"):
        fastdecode.from_pretrained("tiny-llama", device="cpu").generate(
            "hi", max_new_tokens=2, method="dflash"
        )
    with pytest.raises(ConfigError, match="needs decoder.drafter"):  # the DFlash drafter is not a head
        fast.generate("hi", max_new_tokens=2, method="eagle3")


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


def write_acceptance(directory: Path, entries: list[dict]) -> None:
    """``acceptance.json`` as the LayerSkip recipe writes it into ``final/`` (fastdecode/plan/acceptance.py)."""
    body = {"format": 1, "measured_on": "test", "tokens": 100, "drafters": entries}
    (directory / "acceptance.json").write_text(json.dumps(body))


def test_the_default_decoder_is_what_the_checkpoint_expects_to_pay(checkpoint_dir, tmp_path):
    """With a record of high acceptance at E (the LayerSkip recipe writes it into ``final/``), the default
    chains prompt lookup before that exit; with a poor one, the exit is named as not paying."""
    import shutil

    for acceptance, expected in ((0.99, "self_speculative"), (0.01, "prompt_lookup")):
        final = tmp_path / str(acceptance) / "final"
        shutil.copytree(checkpoint_dir, final)
        write_acceptance(final, [{"drafter": "exit", "exit_layer": 3, "acceptance": acceptance}])
        fd = fastdecode.from_pretrained(str(final), device="cpu", dtype="float32")
        out = fd.generate("Tell me", max_new_tokens=10)
        assert out.method == expected and out.candidate is fd.plan().best
        assert out.text == fd.generate("Tell me", max_new_tokens=10, method="autoregressive").text
        assert_drafted_and_accepted(out.output, expected)
        if expected == "self_speculative":
            assert out.config.chain and out.config.exit_layer == 3 and "exit" in out.output.by_proposer
        else:
            assert fd.plan().not_paying[0]["exit"] == 3


def test_auto_runs_exactly_the_drafter_it_priced(checkpoint_dir, tmp_path, monkeypatch):
    """The checkpoint ships ``draft_vocab.json`` (a default of ``self_speculative``), but the plan priced the
    exit with the full head: ``auto`` must draft with the full head, and with the draft vocabulary only when
    that is what the plan priced. Every option the candidate carries is the call's."""
    import shutil

    import fastdecode.drafters.exits.kind as self_speculative

    seen = []  # the draft head each exit proposer was built with
    real = self_speculative.ExitProposer
    monkeypatch.setattr(
        self_speculative, "ExitProposer", lambda *a, **k: seen.append(k["vocab"]) or real(*a, **k)
    )
    for head, vocab in (("full", None), ("draft", "draft_vocab.json")):
        final = tmp_path / head / "final"
        shutil.copytree(checkpoint_dir, final)
        worse = 0.5 if vocab is None else 0.99
        write_acceptance(
            final,
            [
                {"drafter": "exit", "exit_layer": 3, "acceptance": 0.99 if vocab is None else 0.5},
                {"drafter": "exit", "exit_layer": 3, "draft_vocab": "draft_vocab.json", "acceptance": worse},
            ],
        )
        fd = fastdecode.from_pretrained(str(final), device="cpu", dtype="float32")
        out = fd.generate("Tell me", max_new_tokens=10)
        wanted = None if vocab is None else str(final / vocab)
        assert out.candidate.options["draft_vocab"] == wanted and (seen[-1] is None) == (vocab is None)
        for key, value in out.candidate.options.items():
            assert getattr(out.config, key) == value, key


def test_a_checkpoint_carries_its_own_record(checkpoint_dir, tmp_path):
    """The record is read from the model directory only: an intermediate ``checkpoint-N/`` of the same run
    does not borrow the final model's, and a damaged one is refused by name before the weights load."""
    import shutil

    from fastdecode.plan.acceptance import RecordError

    run = tmp_path / "run"
    shutil.copytree(checkpoint_dir, run / "final")
    shutil.copytree(checkpoint_dir, run / "checkpoint-5")
    write_acceptance(run / "final", [{"drafter": "exit", "exit_layer": 3, "acceptance": 0.99}])
    assert fastdecode.from_pretrained(str(run / "final")).plan().best.method == "self_speculative"
    assert fastdecode.from_pretrained(str(run / "checkpoint-5")).plan().best.method == "prompt_lookup"
    (run / "final" / "acceptance.json").write_text('{"format": 1, "drafters": [{"drafter": "exit", "acc')
    with pytest.raises(RecordError, match=r"acceptance.json is damaged.*record=true"):
        fastdecode.from_pretrained(str(run / "final"))


def test_the_plan_is_kept_per_batch_size_and_engine(fd):
    """A batch verifies as wide as its longest draft: its costs (and so its plan) are its own."""
    one, four = fd.plan(1), fd.plan(4)
    assert one is fd.plan(1) and four is not one and fd.plan(3) is four  # priced at the next power of two
    assert fd.plan(1, fast_layers=False) is not one
    out = fd.generate(["Hello there", "Hi", "Hey", "Yo"], max_new_tokens=6)
    assert out.candidate is four.best


def test_a_head_retrained_in_place_is_planned_again(fd, tmp_path):
    """The plan is kept per version of the head's files: its ``acceptance.json`` rewritten in the same
    directory with other numbers, the next ``plan()`` prices those."""
    import os

    from fastdecode.plan.acceptance import AcceptanceRecord, DrafterRecord, write_record
    from tests.eagle3_heads import random_head_dir

    path = random_head_dir(tmp_path)
    rounds = {1: 1.97, 2: 2.9, 3: 3.8, 4: 4.7, 5: 5.5, 6: 6.3}
    record = write_record(path, AcceptanceRecord([DrafterRecord("eagle3", 0.97, tokens_per_round=rounds)]))
    paying = fd.plan(1, costs="estimated", drafter=path)
    assert "eagle3" in [c.method for c in paying.candidates]
    assert fd.plan(1, costs="estimated", drafter=path) is paying  # kept while the files are unchanged
    stat = record.stat()
    write_record(path, AcceptanceRecord([DrafterRecord("eagle3", 0.05, tokens_per_round={1: 1.05})]))
    os.utime(record, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new version on any clock
    again = fd.plan(1, costs="estimated", drafter=path)
    assert [c.method for c in again.candidates] == ["prompt_lookup"]
    assert again.not_paying[0]["drafter"] == "eagle3" and again.not_paying[0]["acceptance"] == 0.05


def test_every_model_generates_by_default():
    """A model that records no exit or adapter still generates with the default (prompt lookup)."""
    out = fastdecode.from_pretrained("tiny-llama").generate("hello", max_new_tokens=6)
    assert out.method == "prompt_lookup" and len(out.ids[0]) == 6


def test_from_pretrained_names_what_it_cannot_load(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="neither a model directory, a hub id.*tiny-llama"):
        fastdecode.from_pretrained("no-such-model")
    monkeypatch.setattr("fastdecode.api.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for path in (str(tmp_path / "no" / "such"), "./no-such-dir", "~/no-such-dir/x"):
        with pytest.raises(
            ConfigError, match=rf"from_pretrained\('{re.escape(path)}'\): the path does not exist"
        ):
            fastdecode.from_pretrained(path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="the path is not a directory"):
        fastdecode.from_pretrained(str(tmp_path / "config.json"))


@pytest.mark.parametrize(
    "value,shown", [("ab", "'ab'"), (99, "99"), (-1, "-1"), (0, "0"), (True, "True"), (3.0, "3.0")]
)
def test_a_recorded_exit_that_is_no_layer_is_refused_before_the_weights_load(
    checkpoint_dir, tmp_path, monkeypatch, value, shown
):
    """``fastdecode.json``'s exit_layer must be an int in [1, L - 1] of the checkpoint's config.json (4 layers)."""
    import shutil

    from fastdecode.files.checkpoint import CheckpointError

    final = tmp_path / "final"
    shutil.copytree(checkpoint_dir, final)
    write_sidecar(final, recipe="layerskip", run_name="layerskip-tiny-llama", exit_layer=value)
    monkeypatch.setattr("fastdecode.api.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    message = (
        rf"{re.escape(str(final / 'fastdecode.json'))}: exit_layer={re.escape(shown)} is not an exit layer"
    )
    with pytest.raises(CheckpointError, match=message + r".*has 4 layers.*int in \[1, 3\]"):
        fastdecode.from_pretrained(str(final), device="cpu", dtype="float32")


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
