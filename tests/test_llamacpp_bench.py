"""llama.cpp beside fastdecode (``eval/llamacpp.py``): the command line, the interleaving order, the report from
fake worker results, the worker protocol against a stand-in ``llama_cpp`` module, the refusal when llama-cpp-python
is missing, and (``slow``, with llama-cpp-python installed) a short real run on the embedded GGUF."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from fastdecode.bench import llamacpp
from fastdecode.bench.llamacpp import LlamaCppJob, Side, measure_threads, parse_method, schedule, summarise
from fastdecode.bench.llamacpp_worker import (
    FASTDECODE,
    LLAMA,
    LlamaCppMissingError,
    Worker,
    WorkerError,
    llama_cpp_available,
    peak_rss_bytes,
    require_llama_cpp,
)
from fastdecode.config import ConfigError
from fastdecode_cli.llamacpp import main, parse_args


def test_command_line_defaults_and_methods_with_options():
    job = parse_args([])
    assert (job.threads, job.methods, job.max_new_tokens, job.model) == (
        [1, 2],
        ["autoregressive", "auto"],
        96,
        "smollm2-135m",
    )
    job = parse_args(
        ["--threads", "1", "--prompts", "4", "--rounds", "1", "--max-new-tokens", "32"]
        + [
            "--method",
            "autoregressive",
            "--method",
            'auto:weights=int4,draft_tokens=4,suffix={"global_size": 0}',
        ]
    )
    assert (job.threads, job.n_prompts, job.rounds, job.max_new_tokens) == ([1], 4, 1, 32)
    sides = job.sides()
    assert [s.kind for s in sides] == [LLAMA, FASTDECODE, FASTDECODE]
    assert sides[2].method == "auto"  # options pass through as given, typed when they read as JSON
    assert sides[2].options == {"weights": "int4", "draft_tokens": 4, "suffix": {"global_size": 0}}
    assert parse_args(["--prompts", "all"]).n_prompts is None


@pytest.mark.parametrize(
    "text, named", [("nonsense", "no decoder"), ("auto:weights", "KEY=VALUE"), ("auto:=3", "KEY=VALUE")]
)
def test_a_bad_method_is_refused_by_name(text, named):
    with pytest.raises(ConfigError, match=named):
        parse_method(text)


def test_bad_values_fail_in_one_line_before_any_work(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--threads", "one,two"])
    assert exit_info.value.code == 2
    assert "error: --threads 'one,two'" in capsys.readouterr().err
    for job, named in [
        (LlamaCppJob(threads=[0]), "threads"),
        (LlamaCppJob(rounds=0), "rounds"),
        (LlamaCppJob(methods=["auto", "auto"]), "once"),
        (LlamaCppJob(methods=[]), "method"),
    ]:
        with pytest.raises(ConfigError, match=named):
            llamacpp.run(job, start=lambda spec: pytest.fail("nothing may start"))


def test_missing_llama_cpp_is_refused_naming_the_extra(monkeypatch):
    monkeypatch.setattr(llamacpp, "llama_cpp_available", lambda: False)
    with pytest.raises(LlamaCppMissingError, match=r"'llamacpp' extra.*-mno-amx-int8"):
        llamacpp.run(LlamaCppJob())  # before any model, prompt or worker
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # an import of it fails
    with pytest.raises(LlamaCppMissingError, match="llamacpp"):
        require_llama_cpp()


class FakeWorker:
    """A worker that answers at once: llama.cpp repeats the prompt's last token, ours counts up from it."""

    def __init__(self, spec: dict, log: list) -> None:
        self.spec, self.log, self.closed = spec, log, False
        self.ready = {"eos": [2, 7]} if spec["side"] == FASTDECODE else {"version": "fake"}

    def request(self, op: str, **fields) -> dict:
        if op == "stats":
            return {"ok": True, "peak_rss": 1000 if self.spec["side"] == LLAMA else 3000}
        self.log.append((self.spec["side"], fields))
        last, n = fields["ids"][-1], fields["max_new_tokens"]
        tokens = [last] * n if self.spec["side"] == LLAMA else list(range(last, last + n))
        return {"ok": True, "tokens": tokens, "ttft_s": 0.1, "decode_s": 0.5, "decode_tokens": n - 1}

    def close(self) -> None:
        self.closed = True


def test_the_sides_are_interleaved_prompt_by_prompt_on_the_same_ids():
    job = LlamaCppJob(rounds=2, warmup=1, max_new_tokens=3, methods=["autoregressive", "auto:weights=int4"])
    prompts = [("p0", [5, 6]), ("p1", [8, 9, 10])]
    log, started = [], []

    def start(spec):
        started.append(FakeWorker(spec, log))
        return started[-1]

    calls, info = measure_threads(job, prompts, 2, {"model": "m", "gguf": "g.gguf", "n_ctx": 64}, start)
    assert [w.spec["threads"] for w in started] == [2, 2] and all(w.closed for w in started)
    assert info == {
        FASTDECODE: {"eos": [2, 7], "peak_rss": 3000},
        LLAMA: {"version": "fake", "peak_rss": 1000},
    }
    order = [(side, f["ids"], f.get("method"), f.get("options")) for side, f in log]
    warmups = [
        (LLAMA, [5, 6], None, None),
        (FASTDECODE, [5, 6], "autoregressive", {}),
        (FASTDECODE, [5, 6], "auto", {"weights": "int4"}),
    ]
    one_round = [(side, ids, m, o) for _, ids in prompts for side, _, m, o in warmups]
    assert order == warmups + one_round + one_round
    assert all(f["stop"] == [2, 7] and f["max_new_tokens"] == 3 for _, f in log)  # our EOS on both sides
    assert [(c["round"], c["prompt"], c["side"]) for c in calls] == [
        (r, i, s.label) for r, i, s in ((r, prompts[i][0], s) for r, i, s in schedule(2, 2, job.sides()))
    ]


def _call(side: str, prompt: str, tokens: list[int], *, round_: int = 0, decode_s: float = 1.0) -> dict:
    return {
        "threads": 1,
        "round": round_,
        "prompt": prompt,
        "side": side,
        "tokens": tokens,
        "ttft_s": 0.05 if side == LLAMA else 0.1,
        "decode_s": decode_s,
        "decode_tokens": len(tokens) - 1,
        "total_s": 0.05 + decode_s,
    }


def test_the_report_from_fake_results(tmp_path, monkeypatch):
    sides = [Side(LLAMA, LLAMA), parse_method("autoregressive"), parse_method("auto")]
    calls = [
        _call(LLAMA, "a", [1, 2, 3, 4, 5]),  # 4 decode tokens in 1 s
        _call("autoregressive", "a", [1, 2, 3, 9, 9], decode_s=2.0),  # parts from llama.cpp at position 3
        _call("auto", "a", [1, 2, 3, 9, 9], decode_s=0.5),
        _call(LLAMA, "b", [4, 5]),
        _call("autoregressive", "b", [4, 5], decode_s=0.5),
        _call("auto", "b", [4, 5], decode_s=0.25) | {"ran": "prompt_lookup"},
        _call(LLAMA, "a", [1, 2, 3, 4, 5], round_=1, decode_s=2.0),  # a later round: timed, not compared
    ]
    info = {1: {LLAMA: {"peak_rss": 100 << 20}, FASTDECODE: {"peak_rss": 300 << 20}}}
    rows = {r["side"]: r for r in summarise(calls, sides, info)}
    assert rows[LLAMA]["decode_tok_s"] == pytest.approx((4 + 1 + 4) / (1 + 1 + 2))
    assert rows[LLAMA]["decode_tok_s_round_std"] is not None  # two rounds: a spread
    assert rows["autoregressive"]["decode_tok_s"] == pytest.approx(5 / 2.5)
    assert rows["auto"]["vs_llamacpp"] == pytest.approx((5 / 0.75) / (9 / 4))
    assert rows["auto"]["ttft_vs_llamacpp"] == pytest.approx(2.0)
    assert rows["autoregressive"]["agree_llamacpp"] == {
        "identical": 1,
        "prompts": 2,
        "mean_common_prefix": 2.5,
    }
    assert rows["auto"]["agree_autoregressive"] == {"identical": 2, "prompts": 2, "mean_common_prefix": 3.5}
    assert (
        rows[LLAMA]["agree_autoregressive"]["identical"] == 1
        and rows["autoregressive"]["agree_autoregressive"] is None
    )
    assert rows["auto"]["ran"] == ["prompt_lookup"] and rows["auto"]["peak_rss_bytes"] == 300 << 20
    meta = {
        "model": "smollm2-135m",
        "gguf": "/cache/SmolLM2.gguf",
        "cpu": "Some CPU 9000",
        "machines": {"1": "Some CPU 9000, 1 thread"},
        "threads": [1],
        "data": "mt_bench",
        "prompts": 2,
        "max_new_tokens": 5,
        "rounds": 2,
        "warmup": 1,
        "llama_cpp": {"version": "0.3.36"},
        "fastdecode": {"version": "0.1.0", "torch": "2.x"},
    }
    result = {"meta": meta, "summary": list(rows.values()), "calls": calls}
    llamacpp.write(result, tmp_path / "out")
    table = (tmp_path / "out" / "llamacpp.md").read_text()
    assert "CPU: Some CPU 9000" in table and "## Some CPU 9000, 1 thread" in table
    assert (
        "| auto | 6.7 | 2.96x | 100.0 | 2.00x | 300.0 MiB | 3.5 | 1/2, 2.5 | 2/2, 3.5 | prompt_lookup |"
        in table
    )
    assert json.loads((tmp_path / "out" / "llamacpp.json").read_text())["summary"][0]["side"] == LLAMA
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["llamacpp.json", "llamacpp.md"]


FAKE_LLAMA_CPP = """
import os
__version__ = "0.0-fake"

def llama_print_system_info():
    return b"AVX = 1 | AMX_INT8 = 0"

class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, **kwargs):
        assert n_threads == n_threads_batch == 1 and kwargs["draft_model"] is None and not kwargs["verbose"]
        self._n_ctx, self.evaluated = n_ctx, 0
        print("a python print of the library")
        os.write(1, b"a C library's log on fd 1\\n")  # must not reach the protocol stream

    def n_ctx(self):
        return self._n_ctx

    def reset(self):
        self.evaluated = 0

    def generate(self, tokens, reset, temp, **kwargs):
        assert temp == 0.0 and self.evaluated == 0  # every prompt prefilled whole
        token = tokens[-1]
        while True:
            token += 1
            yield token
"""


def test_a_real_worker_serves_a_stand_in_llama_cpp_and_reports_its_own_peak(tmp_path, monkeypatch):
    (tmp_path / "llama_cpp.py").write_text(textwrap.dedent(FAKE_LLAMA_CPP))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    ballast = bytearray(300 << 20)  # the driver's peak: a worker must not report it as its own
    ballast[::4096] = b"\1" * len(ballast[::4096])
    worker = Worker({"side": LLAMA, "threads": 1, "gguf": "x.gguf", "n_ctx": 64})
    try:
        assert worker.ready["version"] == "0.0-fake" and worker.ready["n_ctx"] == 64
        reply = worker.request("generate", ids=[1, 2, 10], max_new_tokens=4, stop=[13])
        assert reply["tokens"] == [11, 12, 13] and reply["decode_tokens"] == 2  # stopped at (and kept) EOS
        assert reply["ttft_s"] > 0 and reply["decode_s"] >= 0
        assert worker.request("generate", ids=[5], max_new_tokens=2, stop=[])["tokens"] == [6, 7]
        peak = worker.request("stats")["peak_rss"]
        assert 0 < peak < 300 << 20 < peak_rss_bytes()
        with pytest.raises(RuntimeError, match="TypeError"):  # a bug in a request: raised with its traceback
            worker.request("generate", ids=[1])
    finally:
        worker.close()
    assert worker.process.returncode == 0
    del ballast


def test_a_worker_without_llama_cpp_refuses_naming_the_extra(tmp_path, monkeypatch):
    (tmp_path / "llama_cpp.py").write_text(
        "raise ImportError('libllama.so: cannot open shared object file')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(WorkerError, match=r"llama.cpp worker: .*'llamacpp' extra.*libllama.so"):
        Worker({"side": LLAMA, "threads": 1, "gguf": "x.gguf", "n_ctx": 64})


@pytest.mark.slow
@pytest.mark.skipif(
    not llama_cpp_available(), reason="llama-cpp-python (the llamacpp extra) is not installed"
)
def test_a_short_real_run_on_the_embedded_gguf(tmp_path):
    job = LlamaCppJob(
        n_prompts=2, max_new_tokens=8, rounds=1, warmup=0, threads=[1], output_dir=str(tmp_path)
    )
    job.methods = ["autoregressive"]
    result = llamacpp.run(job)
    rows = {r["side"]: r for r in result["summary"]}
    assert set(rows) == {LLAMA, "autoregressive"} and len(result["calls"]) == 4
    for row in rows.values():
        assert row["decode_tok_s"] > 0 and row["ttft_ms_median"] > 0 and row["peak_rss_bytes"] > 0
        assert 0 < row["mean_tokens"] <= 8
    # the same token ids went in: greedy answers of the same weights start alike (Q4_1 kernels round
    # differently from our fp32 dequantisation, so they may part later)
    assert rows["autoregressive"]["agree_llamacpp"]["mean_common_prefix"] >= 1
    assert (
        result["meta"]["llama_cpp"]["version"] == "0.3.36"
        and "AMX_INT8 = 1" not in result["meta"]["llama_cpp"]["system_info"]
    )
    assert result["meta"]["cpu"] in (tmp_path / "llamacpp.md").read_text()
