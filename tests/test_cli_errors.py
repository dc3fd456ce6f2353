"""A user error reaches a command-line user as one line: ``error: <message>`` on stderr, exit code 2.

Every console script of ``pyproject.toml`` is run in a subprocess with a value it refuses before any model
loads; ``HYDRA_FULL_ERROR=1`` shows the traceback instead; other exceptions keep theirs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastdecode.config import ConfigError
from fastdecode.errors import DiskFullError, UserError
from fastdecode.files.locks import LockHeld
from fastdecode_cli.launch import USER_ERROR_EXIT, one_line_errors

ROOT = Path(__file__).resolve().parents[1]

# console script -> (its module, arguments it refuses before any model loads, a word of the message)
BAD_INPUT = {
    "fastdecode-train": ("train", ["trainer.max_steps=abc", "model=tiny-llama"], "trainer.max_steps"),
    "fastdecode-collect": ("collect", ["batch_size=0", "model=tiny-llama"], "batch_size=0"),
    "fastdecode-speed": ("speed", ["n_prompts=abc", "model=tiny-llama"], "n_prompts"),
    "fastdecode-exits": ("exits", ["prompts=abc", "model=tiny-llama"], "prompts"),
    "fastdecode-engine": ("engine", ["threads=abc"], "threads"),
    "fastdecode-regenerate": ("regenerate", ["num_prompts=0", "model=tiny-llama"], "num_prompts"),
    "fastdecode-skipdecode-quality": ("skipdecode_quality", ["prompts=abc", "model=tiny-llama"], "prompts"),
    "fastdecode-collect-throughput": (
        "collect_throughput",
        ["batch_size=0", "model=tiny-llama"],
        "batch_size",
    ),
    "fastdecode-train-cost": ("train_cost", ["--model", "nosuch"], "Unknown model 'nosuch'"),
    "fastdecode-lookup-replay": ("lookup_replay", ["num_prompts=0", "model=tiny-llama"], "num_prompts"),
    "fastdecode-export-exit": ("export_exit", ["exit_layer=abc", "checkpoint=nosuch"], "exit_layer"),
    "fastdecode-eagle3-check": ("eagle3_check", ["model=nosuch"], "nosuch"),
    "fastdecode-suffix-index": ("suffix_index", ["max_depth=abc", "model=tiny-llama"], "max_depth"),
    "fastdecode-call-overhead": ("call_overhead", ["--tokens", "0", "--model", "tiny-llama"], "--tokens"),
    "fastdecode-llamacpp": ("llamacpp", ["--threads", "abc"], "--threads"),
}


def _run(module: str, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE")}
    environ |= {"PYTHONPATH": str(ROOT)} | env
    cmd = [sys.executable, "-m", f"fastdecode_cli.{module}", *args]
    return subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=300)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_every_console_script_is_covered():
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    scripts = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', section, re.M))  # no tomllib on Python 3.10
    assert set(scripts) == set(BAD_INPUT)
    for name, target in scripts.items():
        assert target == f"fastdecode_cli.{BAD_INPUT[name][0]}:main"


@pytest.mark.parametrize("script", sorted(BAD_INPUT))
def test_a_config_error_is_one_line_and_exit_code_2(script, tmp_path):
    module, args, word = BAD_INPUT[script]
    out = _run(module, args, tmp_path)
    lines = _lines(out.stderr)
    assert out.returncode == USER_ERROR_EXIT, out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and word in lines[0]
    assert "Traceback" not in out.stderr + out.stdout
    assert "Error executing job" not in out.stderr + out.stdout


@pytest.mark.parametrize(
    "args", [["trainer.max_steps=abc"], ["model=smollm2-135"]], ids=["in-the-task", "before-hydra"]
)
def test_hydra_full_error_shows_the_traceback(args, tmp_path):
    out = _run("train", args, tmp_path, HYDRA_FULL_ERROR="1")
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "ConfigError" in out.stderr
    assert not any(line.startswith("error: ") for line in out.stderr.splitlines())


def test_only_rank_0_prints_but_every_rank_exits_2(tmp_path):
    rank1 = _run("train", ["model=smollm2-135"], tmp_path, RANK="1", WORLD_SIZE="2")
    rank0 = _run("train", ["model=smollm2-135"], tmp_path, RANK="0", WORLD_SIZE="2")
    assert rank1.returncode == rank0.returncode == USER_ERROR_EXIT
    assert _lines(rank1.stderr) == []
    assert _lines(rank0.stderr)[0].startswith(
        "error: Unknown model 'smollm2-135'. Did you mean 'smollm2-135m'?"
    )


@pytest.mark.parametrize(
    "err", [ConfigError("bad key"), LockHeld("held by 12"), DiskFullError("disk full", "/x")], ids=type
)
def test_every_named_error_is_a_user_error_printed_in_one_line(err, capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("RANK", raising=False)

    @one_line_errors
    def fails():
        raise err

    assert isinstance(err, UserError)
    with pytest.raises(SystemExit) as exited:
        fails()
    assert exited.value.code == USER_ERROR_EXIT
    assert capsys.readouterr().err == f"error: {err}\n"


def test_other_exceptions_and_exits_pass_through(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    @one_line_errors
    def bug():
        raise KeyError("a bug keeps its traceback")

    @one_line_errors
    def leaves():
        raise SystemExit(0)

    with pytest.raises(KeyError):
        bug()
    with pytest.raises(SystemExit) as exited:
        leaves()
    assert exited.value.code == 0


@pytest.mark.parametrize(
    "override,word",
    [
        ("foo", "cannot read the override 'foo': it has no '='"),
        ("decoder=[autoregressive", "cannot read the override 'decoder=[autoregressive'"),
        ("n_prompts='3", 'Hydra cannot read what starts at "\'3"'),
        ("decoder=[autoregresive]", "Unknown decoder 'autoregresive'. Did you mean 'autoregressive'?"),
        (
            "decoder=[autoregressive,prompt_lokup]",
            "Unknown decoder 'prompt_lokup'. Did you mean 'prompt_lookup'?",
        ),
    ],
)
def test_an_override_hydra_cannot_read_or_a_misspelt_list_option_is_one_line(override, word, tmp_path):
    """Hydra's grammar errors and a misspelt option of a list-valued group (``decoder=[...]``) get our one
    line (Hydra would print its banner, exit 1, and no did-you-mean)."""
    out = _run("speed", [override], tmp_path)
    lines = _lines(out.stderr)
    assert out.returncode == USER_ERROR_EXIT, out.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and word in lines[0], out.stderr
    assert "key=value" in lines[0] or "Choices:" in lines[0]


def test_a_message_of_several_lines_is_printed_as_one(capsys, monkeypatch):
    """A named error whose text spans lines (one quoting another program's output) is still one line."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("RANK", raising=False)

    @one_line_errors
    def fails():
        raise ConfigError("loading failed (ValueError: first\n    second line).\nFix it.")

    with pytest.raises(SystemExit):
        fails()
    assert capsys.readouterr().err == "error: loading failed (ValueError: first second line). Fix it.\n"


def test_a_refused_run_leaves_nothing_it_created(tmp_path):
    """Hydra makes the run directory (``.hydra/``, the job's log) before the task runs: a run the task then
    refuses removes them, and the parents made on the way; a directory that was there keeps what it held."""
    out = _run(
        "train", ["model=tiny-llama", "trainer.max_steps=abc", f"output_dir={tmp_path}/new/run"], tmp_path
    )
    assert out.returncode == USER_ERROR_EXIT and "trainer.max_steps" in out.stderr
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "old"
    (kept / "checkpoint-2").mkdir(parents=True)
    out = _run("train", ["model=tiny-llama", "trainer.max_steps=abc", f"output_dir={kept}"], tmp_path)
    assert out.returncode == USER_ERROR_EXIT
    assert (kept / "checkpoint-2").is_dir()


def test_train_cost_reports_its_subprocess_errors(tmp_path, capsys):
    """The peak-memory subprocess: its user error reaches the user as one line (ours, naming the kind), its
    crash as its traceback; an unknown kind is refused before any model loads."""
    from fastdecode_cli.train_cost import memory_in_subprocess
    from layerskip_train.step_cost import StepShape

    with pytest.raises(UserError, match=r"measuring the peak memory of plain: Unknown model 'nosuch'"):
        memory_in_subprocess(StepShape("nosuch", 1, 8, 1), "plain")
    with pytest.raises(RuntimeError, match=r"the peak-memory subprocess of bogus failed \(exit code 1\)"):
        memory_in_subprocess(StepShape("tiny-llama", 1, 8, 1), "bogus")
    child = capsys.readouterr().err  # the child's traceback, not discarded
    assert "Traceback" in child and "KeyError: 'bogus'" in child
    out = _run("train_cost", ["--model", "tiny-llama", "--kinds", "plain,layerskp"], tmp_path)
    assert out.returncode == USER_ERROR_EXIT and len(_lines(out.stderr)) == 1, out.stderr
    assert "Unknown step kind 'layerskp'. Did you mean 'layerskip'?" in out.stderr


def test_a_corpus_of_empty_answers_is_refused_in_one_line_and_nothing_is_written(tmp_path):
    """``fastdecode-suffix-index`` over answers that are all empty (was: exit 0, "0 sequences", a file that
    drafts nothing): one line naming the input and why, exit 2, before the tokenizer loads; no file."""
    source, output = tmp_path / "answers.jsonl", tmp_path / "corpus.sfx"
    source.write_text('{"prompt": "q", "response": ""}\n\n{"text": ""}\n')
    out = _run("suffix_index", ["model=tiny-llama", f"input={source}", f"output={output}"], tmp_path)
    lines = _lines(out.stderr)
    assert out.returncode == USER_ERROR_EXIT and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"error: input={str(source)!r} has no non-empty response (2 records")
    assert "Traceback" not in out.stderr + out.stdout and not output.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl"]
