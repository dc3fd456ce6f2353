"""The built wheel installs into a fresh virtual environment and its console scripts work from any folder.

A non-editable install has no repository beside it: the configs must come from the package data and every
top-level package must be in the wheel. The venv has no access to the system site-packages, so nothing can be
imported from this checkout or its editable install by accident; torch==2.13.0 is the CPU build on these
machines (the README's install line).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "fastdecode",
    "fastdecode_cli",
    "recipes",
    "layerskip_train",
    "cllm_train",
    "skipdecode_train",
    "adapter_train",
    "eagle3_train",
)

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with torch and the wheel built from this checkout (deps resolved by pip)."""
    base = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(ROOT), "-w", str(base / "dist")], base)
    (wheel,) = (base / "dist").glob("fastdecode-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} >= set(PACKAGES)
    assert "fastdecode/configs/train.yaml" in names and "fastdecode/configs/deepspeed/zero3.json" in names
    _run([sys.executable, "-m", "venv", str(base / "venv")], base)
    pip = [str(base / "venv" / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, "torch==2.13.0", str(wheel)], base)
    return base / "venv"


def test_wheel_imports_from_the_venv_not_the_checkout(venv, tmp_path):
    code = "import json, importlib; print(json.dumps({p: importlib.import_module(p).__file__ for p in %r}))"
    files = json.loads(_run([str(venv / "bin" / "python"), "-c", code % (PACKAGES,)], tmp_path).stdout)
    for package, path in files.items():
        assert Path(path).is_relative_to(venv), f"{package} imported from {path}, not from the venv"


def test_console_scripts_compose_and_train_from_another_folder(venv, tmp_path):
    train = str(venv / "bin" / "fastdecode-train")
    job = _run([train, "--cfg", "job", "model=tiny-llama"], tmp_path).stdout
    assert "tiny-llama" in job and "trainer:" in job
    hydra_scripts = (
        "fastdecode-collect",
        "fastdecode-speed",
        "fastdecode-exits",
        "fastdecode-engine",
        "fastdecode-regenerate",
        "fastdecode-skipdecode-quality",
        "fastdecode-collect-throughput",
        "fastdecode-lookup-replay",
        "fastdecode-suffix-index",
    )
    for script in hydra_scripts:
        assert (
            "model" in _run([str(venv / "bin" / script), "--cfg", "job", "model=tiny-llama"], tmp_path).stdout
        )
    assert "--steps" in _run([str(venv / "bin" / "fastdecode-train-cost"), "--help"], tmp_path).stdout
    assert "--tokens" in _run([str(venv / "bin" / "fastdecode-call-overhead"), "--help"], tmp_path).stdout
    assert "--gguf" in _run([str(venv / "bin" / "fastdecode-llamacpp"), "--help"], tmp_path).stdout
    export = [str(venv / "bin" / "fastdecode-export-exit"), "--cfg", "job", "checkpoint=some/final"]
    assert "exit_layer" in _run(export, tmp_path).stdout  # no model group: the checkpoint is the model
    check = [str(venv / "bin" / "fastdecode-eagle3-check"), "model=tiny-llama", "model.device=cpu", "out=e3"]
    assert '"head_step_s"' in _run(check, tmp_path).stdout  # a training step of a head, and the head written
    assert (tmp_path / "e3" / "head" / "config.json").is_file()
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n")[1].split("\n[")[0]
    declared = {line.split("=")[0].strip() for line in section.splitlines() if "=" in line}
    others = {
        "fastdecode-train",
        "fastdecode-train-cost",
        "fastdecode-call-overhead",
        "fastdecode-llamacpp",
        "fastdecode-export-exit",
        "fastdecode-eagle3-check",
    }
    assert declared == {*hydra_scripts, *others}  # every one tested here
    assert all((venv / "bin" / script).is_file() for script in declared)
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Say {i}.", "response": f"{i} {i}"}) + "\n" for i in range(12))
    )
    out = tmp_path / "run"
    overrides = ["recipe=sft", "model=tiny-llama", "data=jsonl", f"data.path={data}", "data.held_out=2"]
    overrides += ["trainer.max_steps=2", "trainer.save_strategy=no", f"output_dir={out}"]
    _run([train, *overrides], tmp_path)
    assert (out / "final" / "model.safetensors").is_file()
    assert (out / "config.yaml").is_file()
