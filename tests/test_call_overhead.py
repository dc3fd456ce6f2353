"""The public call's work beside its decoder: the type hints ``to_dataclass`` reads are resolved once per class
(every ``generate`` builds a ``DecodeConfig``), never kept for another class of the same name; and the
measurement behind ``eval/call_overhead.py`` runs, compares equal outputs and profiles the work outside the
decoder."""

from __future__ import annotations

import dataclasses
import typing

import pytest

import fastdecode
import fastdecode.config
from fastdecode.bench.call_overhead import own_work, paired, profile_outside, recorded_decoder, report
from fastdecode.config import ConfigError, to_dataclass
from fastdecode.decoding.config import DecodeConfig
from fastdecode_cli.call_overhead import parse_args
from fastdecode_cli.call_overhead import run as run_cli
from tests.helpers import tiny_model


@pytest.fixture(scope="module")
def fd():
    model, tokenizer = tiny_model("tiny-llama")
    return fastdecode.FastDecoder(model, tokenizer)


@pytest.fixture
def resolved(monkeypatch):
    """The classes whose type hints are resolved (``typing.get_type_hints``) while the test runs, in order."""
    seen: list[type] = []

    def counting(cls, *args, **kwargs):
        seen.append(cls)
        return typing.get_type_hints(cls, *args, **kwargs)

    monkeypatch.setattr(fastdecode.config, "get_type_hints", counting)
    return seen


def test_generate_resolves_no_type_hints_after_its_first_call(fd, resolved):
    """``DecodeConfig``'s hints are resolved at most once: the second and third calls with the same options
    resolve none (before the cache, each call resolved them: most of the API's own cost per call)."""
    fd.generate([5, 6, 7], max_new_tokens=2, method="autoregressive")
    fd.plan(1, costs="estimated")
    first = len(resolved)
    for _ in range(2):
        fd.generate([5, 6, 7], max_new_tokens=2, method="autoregressive")
        fd.plan(1, costs="estimated")  # the plan's engine config too
    assert resolved.count(DecodeConfig) <= 1 and len(resolved) == first, resolved


def test_type_hints_of_a_class_defined_again_are_its_own(resolved):
    """The hints are keyed by the class: a class defined again under the same name (other annotations) is
    resolved anew and converts by its own types, while the first keeps its own."""

    @dataclasses.dataclass
    class Options:
        size: int = 1

    assert to_dataclass(Options, {"size": 3}, "o").size == 3
    assert to_dataclass(Options, {"size": 4}, "o").size == 4
    assert resolved == [Options]  # once for both calls
    first = Options

    @dataclasses.dataclass
    class Options:  # noqa: F811 (defined again on purpose)
        size: str = "s"

    assert to_dataclass(Options, {"size": "large"}, "o").size == "large"
    assert resolved == [first, Options]
    with pytest.raises(ConfigError, match="o.size"):
        to_dataclass(first, {"size": "large"}, "o")


def test_a_config_from_cached_hints_checks_as_before(resolved):
    """Strict conversion is unchanged with the hints cached: a wrong type and a misspelt key are refused on every
    call, not only the first."""
    for _ in range(2):
        with pytest.raises(ConfigError, match="draft_tokens"):
            to_dataclass(DecodeConfig, {"max_new_tokens": 4, "draft_tokens": "many"}, "generate()")
        with pytest.raises(ConfigError, match="Did you mean 'temperature'"):
            to_dataclass(DecodeConfig, {"max_new_tokens": 4, "temprature": 0.5}, "generate()")
    assert resolved.count(DecodeConfig) <= 1


def test_paired_calls_emit_the_same_tokens_and_time_each_round(fd):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    result = paired(fd, prompts, 3, "autoregressive", repeats=2)
    assert len(result.api_ms) == len(result.direct_ms) == 2 and result.tokens == 3
    assert all(ms > 0 for ms in result.api_ms + result.direct_ms)
    assert result.summary()["rounds"] == 2


def test_the_profile_names_the_work_outside_the_decoder(fd):
    profile = profile_outside(fd, [5, 6, 7, 8], "autoregressive", calls=3)
    names = " ".join(profile["outside_us"])
    assert "config (api.py" in names and "_prompts (api.py" in names
    assert "call (registry.py" not in names  # the decoder is not outside itself
    assert profile["call_us"] >= profile["decoder_us"] > 0
    assert set(profile["decoder_setup_us"]) == {"check", "configure_engine"}


def test_the_command_reports_both_token_counts():
    args = parse_args(["--model", "tiny-llama", "--tokens", "1,4", "--repeats", "1", "--profile-calls", "2"])
    result = run_cli(args)
    assert [r["max_new_tokens"] for r in result["results"]] == [1, 4]
    assert [r["rounds"] for r in result["results"]] == [4, 1]  # the shorter call: more rounds
    text = report(result)
    assert "the API's own work per call" in text and "% of a 4-token answer" in text
    assert "configure_engine" in text and "config (api.py" in text
    assert 0 < result["overhead_share"] and result["own_work_us"]["generate"]["min"] > 0


def test_the_recorded_decoder_stands_in_for_the_decoder_inside_only(fd):
    """``own_work``'s stand-in: inside, ``generate`` returns the recorded output (no decoding: another prompt
    gets the same ids) and still refuses an unknown method; after it, the real decoder runs again."""
    real = fd.generate([5, 6, 7], max_new_tokens=3, method="autoregressive")
    with recorded_decoder(real.output):
        assert fd.generate([9, 9, 9, 9], max_new_tokens=3, method="autoregressive").ids == real.ids
        with pytest.raises(ConfigError, match="autoregressive"):
            fd.generate([5, 6, 7], max_new_tokens=3, method="autoregresive")
    other = fd.generate([9, 9, 9, 9], max_new_tokens=3, method="autoregressive")
    assert other.output is not real.output
    assert set(own_work(fd, [5, 6, 7], "autoregressive", calls=3)) == {
        "generate",
        "check",
        "configure_engine",
    }


@pytest.mark.parametrize(
    ("argv", "word"),
    [(["--tokens", "0"], "--tokens"), (["--tokens", "one"], "--tokens"), (["--method", "auto"], "--method")],
)
def test_the_command_refuses_bad_arguments_before_loading(argv, word):
    with pytest.raises(ConfigError, match=word):
        run_cli(parse_args(["--model", "no-such-model", *argv]))
