"""The corpus of suffix decoding end to end: ``fastdecode-suffix-index`` builds a file that loads and drafts,
refuses evaluation sets; ``generate(corpus=)`` and ``eval/speed.py corpus=`` pass it to the suffix methods,
checked against the tokenizer; the benchmark never lets a prompt's own answer into the global index when that
prompt is decoded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import fastdecode
from fastdecode.config import CONFIG_DIR, ConfigError
from fastdecode.decoding.config import DecodeConfig
from fastdecode.drafters.suffix import proposer as suffix_module
from fastdecode.drafters.suffix import sources
from fastdecode.drafters.suffix.index_file import NotASuffixIndexError, SuffixIndexFingerprintError
from fastdecode.drafters.suffix.options import SuffixOptions
from fastdecode.drafters.suffix.sources import corpus_fingerprint, corpus_index, reset_global_index
from fastdecode.registry import DECODERS
from fastdecode.runtime.model import EarlyExitModel
from fastdecode_cli.suffix_index import run
from tests.helpers import tiny_model
from tests.job_configs import LIVELY, tiny_speed_cfg


@pytest.fixture(autouse=True)
def empty_global_index():
    reset_global_index()
    yield
    reset_global_index()


def build(tmp_path, records, name="answers.jsonl", **extra):
    source = tmp_path / name
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = ["model=tiny-llama", f"input={source}", f"output={tmp_path / 'corpus.sfx'}"]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return run(compose(config_name="suffix_index", overrides=overrides))


def test_the_cli_builds_an_index_that_loads_and_drafts(tmp_path):
    model, tokenizer = tiny_model("tiny-llama")
    m = EarlyExitModel(model)
    answer = "the quick brown fox jumps over the lazy dog, the quick brown fox"
    built = build(tmp_path, [{"prompt": "q", "response": answer}, {"text": "hello there"}])
    assert (built["sequences"], built["nodes"] > 0, built["bytes"] > 0) == (2, True, True)
    ids = tokenizer(answer, add_special_tokens=False).input_ids
    assert built["tokens"] == len(ids) + len(tokenizer("hello there", add_special_tokens=False).input_ids)
    index = corpus_index(built["output"], m, fingerprint=corpus_fingerprint(tokenizer))
    assert index.tokens[index.keys[0]] == ids  # the response's ids alone: no template, no special tokens
    prompt = tokenizer("the quick brown", add_special_tokens=False).input_ids
    cfg = DecodeConfig(max_new_tokens=12, costs="estimated", policy="constant")
    cfg = cfg.with_options(SuffixOptions(corpus=built["output"], global_size=0))
    out = DECODERS["suffix"](m, [prompt], cfg)
    assert out.tokens == DECODERS["autoregressive"](m, [prompt], cfg).tokens and sum(out.drafted) > 0


def test_append_eos_ends_every_sequence_with_it(tmp_path):
    _, tokenizer = tiny_model("tiny-llama")
    built = build(tmp_path, [{"text": "abc"}], append_eos="true")
    index = corpus_index(built["output"], EarlyExitModel(tiny_model("tiny-llama")[0]))
    assert index.tokens[index.keys[0]][-1] == tokenizer.eos_token_id


@pytest.mark.parametrize(
    ("name", "record", "match"),
    [
        ("mt_bench_answers.jsonl", {"prompt": "q", "response": "a"}, "looks like an evaluation set"),
        ("answers.jsonl", {"question_id": 81, "response": "a"}, "evaluation set's record"),
        ("answers.jsonl", {"prompt": "q"}, 'need a "response"'),
    ],
)
def test_the_cli_refuses_evaluation_sets_and_bad_records(tmp_path, name, record, match):
    with pytest.raises(ConfigError, match=match):
        build(tmp_path, [record], name=name)
    assert not (tmp_path / "corpus.sfx").exists()


def test_generate_with_a_corpus_is_exact_and_refuses_another_tokenizer(tmp_path, monkeypatch):
    fd = fastdecode.from_pretrained("tiny-llama")
    built = build(tmp_path, [{"prompt": "q", "response": "one two three one two three one two three"}])
    expected = fd.generate("one two", method="autoregressive", max_new_tokens=10, chat=False)
    out = fd.generate("one two", method="suffix", corpus=built["output"], max_new_tokens=10, chat=False)
    assert out.ids == expected.ids and SuffixOptions.of(out.config).corpus == built["output"]
    with pytest.raises(ConfigError, match="method='suffix'"):
        fd.generate("one two", method="prompt_lookup", corpus=built["output"])
    monkeypatch.setattr(
        "fastdecode.drafters.suffix.sources.tokenizer_fingerprint",
        lambda tok: {"name": "x", "vocab_size": 261, "vocab_hash": "another"},
    )
    with pytest.raises(SuffixIndexFingerprintError, match="another tokenizer"):  # a decoder on another one
        fastdecode.from_pretrained("tiny-llama").generate("one two", method="suffix", corpus=built["output"])


def test_auto_with_a_corpus_drafts_by_suffix_decoding_where_it_would_by_lookup(tmp_path):
    """``choose.with_corpus``: prompt lookup alone becomes suffix decoding over the corpus, a chain's first
    stage becomes suffix decoding, anything else stays; ``generate(method="auto", corpus=)`` runs it, exact."""
    from fastdecode.plan.choose import Candidate, with_corpus

    lookup = Candidate("prompt_lookup", "prompt_lookup", {"chain": False, "draft_tokens": 6}, 1.3, "why")
    found = with_corpus(lookup, "c.sfx")
    assert (found.name, found.method, found.options["suffix"], found.options["draft_tokens"]) == (
        "suffix",
        "suffix",
        {"corpus": "c.sfx"},
        8,
    )
    chain = Candidate("prompt_lookup+exit", "self_speculative", {"chain": True, "exit_layer": 2}, 1.4, "why")
    found = with_corpus(chain, "c.sfx")
    assert found.name == "suffix+exit" and found.method == "self_speculative"
    assert found.options["suffix"] == {"first": True, "corpus": "c.sfx"} and found.options["exit_layer"] == 2
    alone = Candidate("eagle3", "eagle3", {"chain": False}, 1.2, "why")
    assert with_corpus(alone, "c.sfx") == alone
    fd = fastdecode.from_pretrained("tiny-llama")
    built = build(tmp_path, [{"prompt": "q", "response": "one two three one two three one two three"}])
    expected = fd.generate("one two", method="autoregressive", max_new_tokens=10, chat=False)
    out = fd.generate("one two", corpus=built["output"], max_new_tokens=10, chat=False)
    assert out.candidate.name == "suffix" and out.method == "suffix"
    assert out.ids == expected.ids and SuffixOptions.of(out.config).corpus == built["output"]
    assert fd.generate("one two", max_new_tokens=10, chat=False).candidate.name == "prompt_lookup"


def planned_chain(tmp_path):
    """tiny-llama saved with a record of high acceptance at exit 3: ``auto`` plans prompt lookup, else that
    exit (a chain), so with a corpus its plan is a chain with suffix decoding first."""
    model, tokenizer = tiny_model("tiny-llama")
    final = tmp_path / "final"
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    entry = {"drafter": "exit", "exit_layer": 3, "acceptance": 0.99}
    record = {"format": 1, "measured_on": "test", "tokens": 100, "drafters": [entry]}
    (final / "acceptance.json").write_text(json.dumps(record))
    return fastdecode.from_pretrained(str(final), device="cpu", dtype="float32")


def test_a_given_suffix_group_is_merged_into_the_plans_key_by_key(tmp_path):
    """``generate(corpus=PATH, suffix={"global_size": 0})`` under ``auto`` keeps what the plan set in its
    suffix group (``first``, ``corpus``): was replaced wholesale, then refused as a corpus without a suffix
    method."""
    fd = planned_chain(tmp_path)
    built = build(tmp_path, [{"prompt": "q", "response": "one two three one two three one two three"}])
    expected = fd.generate("one two", method="autoregressive", max_new_tokens=10, chat=False)
    out = fd.generate(
        "one two", corpus=built["output"], suffix={"global_size": 0}, max_new_tokens=10, chat=False
    )
    assert out.candidate.name == "suffix+exit" and out.method == "self_speculative" and out.config.chain
    options = SuffixOptions.of(out.config)
    assert (options.first, options.corpus, options.global_size) == (True, built["output"], 0)
    assert out.ids == expected.ids
    lookup = fastdecode.from_pretrained("tiny-llama")  # plans prompt lookup: suffix decoding alone
    out = lookup.generate("one two", corpus=built["output"], suffix={"min_match": 2}, max_new_tokens=10)
    options = SuffixOptions.of(out.config)
    assert (out.method, options.corpus, options.min_match) == ("suffix", built["output"], 2)


def test_a_corpus_of_another_tokenizer_is_refused_wherever_the_tokenizer_is_known(tmp_path):
    """A file whose fingerprint is another tokenizer's of the same size (its ids fit the model): the API
    compares it with the model's tokenizer however the corpus is named (was: ``suffix={"corpus": PATH}``
    compared the file's fingerprint with itself); a decoder called without a tokenizer checks the
    vocabulary size only, and says so."""
    from fastdecode.drafters.suffix.index import SuffixIndex
    from fastdecode.drafters.suffix.index_file import save_index

    fd = fastdecode.from_pretrained("tiny-llama")
    ours = corpus_fingerprint(fd.tokenizer)
    index = SuffixIndex(8)
    index.add(0, fd.tokenizer("one two three one two three", add_special_tokens=False).input_ids)
    other = str(save_index(tmp_path / "other.sfx", index, fingerprint=ours | {"vocab_hash": "another"}))
    for options in (
        {"method": "suffix", "suffix": {"corpus": other}},
        {
            "method": "self_speculative",
            "exit_layer": 2,
            "chain": True,
            "suffix": {"first": True, "corpus": other},
        },
        {"method": "suffix", "corpus": other},
        {"corpus": other},
    ):
        with pytest.raises(SuffixIndexFingerprintError, match="another tokenizer") as caught:
            fd.generate("one two", max_new_tokens=4, chat=False, **options)
        assert "fastdecode-suffix-index command" in str(caught.value), options
    with pytest.raises(SuffixIndexFingerprintError, match="another tokenizer"):
        corpus_index(other, fd.m, fingerprint=ours)
    assert corpus_index(other, fd.m) is not None  # no tokenizer known: the vocabulary size only
    assert "only the vocabulary size is checked" in " ".join(corpus_index.__doc__.split())


def test_a_missing_corpus_says_to_build_it_with_the_command(tmp_path):
    fd = fastdecode.from_pretrained("tiny-llama")
    with pytest.raises(NotASuffixIndexError, match="cannot read it") as caught:
        fd.generate("one two", corpus=str(tmp_path / "none.sfx"), max_new_tokens=4)
    message = str(caught.value)
    assert "the fastdecode-suffix-index command (fastdecode-suffix-index model=" in message
    assert "fastdecode.drafters" not in message and "save_index" not in message


def test_answers_that_are_all_empty_are_refused_before_anything_is_written(tmp_path):
    for records in ([{"prompt": "q", "response": ""}, {"text": ""}], []):
        with pytest.raises(ConfigError, match=r"answers\.jsonl' has no non-empty response"):
            build(tmp_path, records)
        assert not (tmp_path / "corpus.sfx").exists()


def test_the_benchmark_never_drafts_a_prompt_its_own_answer(tmp_path, monkeypatch):
    """Two repeats after a warm-up, with a corpus: every suffix call's global index holds no answer of the
    prompts it decodes (it would without the resets: the warm-up and the first repeat answer them), and the
    outputs equal autoregressive decoding's."""
    from eval.speed import run as run_speed

    built = build(tmp_path, [{"text": "Count from 1 to 6. 1 2 3 4 5 6"}])
    seen, outputs, corpora = [], [], []
    init, remember = suffix_module.SuffixProposer.__init__, suffix_module.remember

    def recording_init(self, s):
        init(self, s)
        index = self.shared.get("global")
        seen.append({tuple(t) for t in index.tokens.values()} if index is not None else set())
        corpora.append("corpus" in self.shared)

    def recording_remember(m, options, stop, rows):
        outputs.append([tuple(r) for r in rows])
        remember(m, options, stop, rows)

    monkeypatch.setattr(suffix_module.SuffixProposer, "__init__", recording_init)
    monkeypatch.setattr(suffix_module, "remember", recording_remember)
    methods = "decoder=[autoregressive,suffix,suffix_no_corpus]"
    cfg = tiny_speed_cfg(tmp_path, methods, "hf_baseline=null", LIVELY, f"corpus={built['output']}")
    result = run_speed(cfg)
    rows = {row["method"]: row for row in result["summary"]}
    for method in ("suffix", "suffix_no_corpus"):
        assert rows[method]["match_rate"] == 1.0 and rows[method]["identical_rows"] == 1.0
    assert len(seen) == len(outputs) == 2 * (1 + 2 * 3)  # per method: the warm-up, then 2 repeats x 3 prompts
    assert sorted(corpora) == [False] * 7 + [True] * 7  # suffix_no_corpus never reads the corpus
    assert any(seen), "the global index was never used"
    for held, answers in zip(seen, outputs, strict=True):
        assert not held & set(answers)


def test_the_benchmark_refuses_a_corpus_without_a_suffix_method_or_file(tmp_path, monkeypatch):
    from eval.speed import run as run_speed

    monkeypatch.setattr(
        "fastdecode.runtime.loading.load_model", lambda *a, **k: pytest.fail("the model loaded")
    )
    built = build(tmp_path, [{"text": "abc abc"}])
    for methods in ("[autoregressive]", "[autoregressive,suffix_no_corpus]"):  # the latter never reads one
        cfg = tiny_speed_cfg(tmp_path, f"decoder={methods}", "hf_baseline=null", f"corpus={built['output']}")
        with pytest.raises(ConfigError, match="read by the suffix methods that use a corpus only"):
            run_speed(cfg)
    missing = tiny_speed_cfg(
        tmp_path, "decoder=[autoregressive,suffix]", "hf_baseline=null", f"corpus={tmp_path / 'none.sfx'}"
    )
    with pytest.raises(NotASuffixIndexError, match="cannot read it"):
        run_speed(missing)


def test_the_benchmarks_auto_row_drafts_over_the_corpus(tmp_path):
    """``eval/speed.py corpus=`` with ``auto``: its candidate row is suffix decoding over the corpus (not prompt
    lookup), and the auto row runs that candidate; both exact."""
    from eval.speed import run as run_speed

    built = build(tmp_path, [{"text": "Count from 1 to 6. 1 2 3 4 5 6"}])
    cfg = tiny_speed_cfg(
        tmp_path, "decoder=[autoregressive,auto]", "hf_baseline=null", LIVELY, f"corpus={built['output']}"
    )
    result = run_speed(cfg)
    rows = {row["method"]: row for row in result["summary"]}
    assert list(rows) == ["autoregressive", "auto", "auto:suffix"]
    assert result["methods"]["auto:suffix"]["decoder"] == "suffix"
    assert rows["auto"]["ran"] == ["suffix"]
    assert rows["auto"]["match_rate"] == 1.0 and rows["auto:suffix"]["match_rate"] == 1.0


def counting_loads(monkeypatch) -> list[Path]:
    """The corpus files read whole from now on (``sources.whole_file``: one call per load)."""
    loads, whole_file = [], sources.whole_file
    monkeypatch.setattr(sources, "whole_file", lambda path: loads.append(Path(path)) or whole_file(path))
    return loads


def test_a_corpus_file_is_loaded_once_whatever_the_eos_ids(tmp_path, monkeypatch):
    """``generate(method="suffix", corpus=PATH)`` twice: the API's check (no EOS ids) and decoding (the
    model's EOS ids) share one load of the file (was: one load per EOS ids and rule, two per file)."""
    built = build(tmp_path, [{"text": "Count from 1 to 6. 1 2 3 4 5 6"}], append_eos="true")
    loads = counting_loads(monkeypatch)
    fd = fastdecode.from_pretrained("tiny-llama")
    expected = fd.generate("Count from 1", method="autoregressive", max_new_tokens=10, chat=False)
    assert fd.config(
        "suffix", max_new_tokens=1
    ).eos_ids  # decoding's EOS ids are not the check's: the loads used to differ
    for _ in range(2):
        out = fd.generate(
            "Count from 1", method="suffix", corpus=built["output"], max_new_tokens=10, chat=False
        )
        assert out.ids == expected.ids
    assert loads == [Path(built["output"])]


def test_a_corpus_over_the_size_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """``decoder.suffix.max_corpus_bytes``: a larger file is refused by the API and by a decoder, naming the
    file, its size, the bound and the option, before its body is read; a bound it fits loads it."""
    from fastdecode.drafters.suffix.sources import SuffixIndexTooLargeError

    built = build(tmp_path, [{"text": "Count from 1 to 6. 1 2 3 4 5 6"}])
    path, size = built["output"], Path(built["output"]).stat().st_size
    loads = counting_loads(monkeypatch)
    fd = fastdecode.from_pretrained("tiny-llama")
    small = {"max_corpus_bytes": size - 1}
    for named in ({"corpus": path, "suffix": small}, {"suffix": small | {"corpus": path}}):
        with pytest.raises(SuffixIndexTooLargeError) as caught:
            fd.generate("one two", method="suffix", max_new_tokens=4, chat=False, **named)
        message = str(caught.value)
        assert path in message and f"({size} bytes)" in message, message
        assert f"max_corpus_bytes={size - 1}" in message and "suffix={'max_corpus_bytes'" in message
    cfg = DecodeConfig(max_new_tokens=4).with_options(SuffixOptions(corpus=path, max_corpus_bytes=size - 1))
    with pytest.raises(SuffixIndexTooLargeError, match="over the bound"):
        DECODERS["suffix"](fd.m, [[1, 2, 3]], cfg)
    assert loads == []
    fd.generate("one two", method="suffix", corpus=path, suffix={"max_corpus_bytes": size}, max_new_tokens=4)
    assert loads == [Path(path)] and SuffixOptions().max_corpus_bytes == 1 << 30
    with pytest.raises(ConfigError, match=r"decoder.suffix.max_corpus_bytes=0 .*need >= 1"):
        SuffixOptions(max_corpus_bytes=0)


def test_the_benchmark_checks_a_corpus_its_methods_name_against_the_tokenizer(tmp_path, monkeypatch):
    """A corpus named by a method's own options (not ``corpus=``) is compared with the benchmark's tokenizer
    before any decoding (was: only a decoder's vocabulary-size check, so another tokenizer's file of the same
    size was drafted from)."""
    from eval.speed import run as run_speed
    from fastdecode.drafters.suffix.index import SuffixIndex
    from fastdecode.drafters.suffix.index_file import save_index

    _, tokenizer = tiny_model("tiny-llama")
    index = SuffixIndex(8)
    index.add(0, tokenizer("Count from 1 to 6", add_special_tokens=False).input_ids)
    other = corpus_fingerprint(tokenizer) | {"vocab_hash": "another"}
    path = save_index(tmp_path / "other.sfx", index, fingerprint=other)
    decoded = []
    monkeypatch.setattr(
        suffix_module.SuffixProposer, "propose", lambda *a: decoded.append(a) or pytest.fail()
    )
    for method in ("suffix_no_corpus", "suffix"):
        named = f"decoder.{method}.options.suffix.corpus={path}"
        cfg = tiny_speed_cfg(tmp_path, f"decoder=[autoregressive,{method}]", "hf_baseline=null", named)
        with pytest.raises(SuffixIndexFingerprintError, match="another tokenizer"):
            run_speed(cfg)
    assert decoded == []
