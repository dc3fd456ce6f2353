"""Layering rules of docs/ARCHITECTURE.md, checked on the source: imports only point down.

``fastdecode.training`` (training-only code shared by the training packages) sits between the training
packages and the rest of ``fastdecode``: the training packages, the recipes and the entry points may import it,
no other ``fastdecode`` module may.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINING = {"layerskip_train", "cllm_train", "skipdecode_train"}
ENTRY = {"fastdecode_cli", "eval"}
SHARED_TRAINING = "fastdecode.training"
FORBIDDEN = {
    "fastdecode": TRAINING | {"fastdecode_recipes"} | ENTRY,
    **{package: (TRAINING - {package}) | {"fastdecode_recipes"} | ENTRY for package in TRAINING},  # own only
    "fastdecode_recipes": ENTRY,
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_only_point_down(package):
    for path in _sources(package):
        for name in _imports(path):
            top = name.split(".")[0]
            assert top not in FORBIDDEN[package], f"{path.relative_to(ROOT)} imports {name}"


def _imports_shared_training(name: str) -> bool:
    return name == SHARED_TRAINING or name.startswith(SHARED_TRAINING + ".")


def test_fastdecode_core_never_imports_the_training_layer():
    """Only ``fastdecode/training/`` itself; the adapter, data, decoders and reports stay Trainer-free."""
    training_dir = ROOT / "fastdecode" / "training"
    for path in _sources("fastdecode"):
        if training_dir in path.parents:
            continue
        bad = sorted(n for n in _imports(path) if _imports_shared_training(n))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}: fastdecode.training is for training code"


def test_the_training_layer_imports_only_fastdecode_core():
    """``fastdecode.training`` is below the training packages: it imports none of them (nor anything above)."""
    above = TRAINING | {"fastdecode_recipes"} | ENTRY
    for path in (ROOT / "fastdecode" / "training").rglob("*.py"):
        bad = sorted(n for n in _imports(path) if n.split(".")[0] in above)
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_only_the_adapter_imports_hf_modeling_code():
    """HF model internals (transformers.models.*) are touched by fastdecode/model.py alone."""
    allowed = {ROOT / "fastdecode" / "model.py"}
    for package in FORBIDDEN:
        for path in _sources(package):
            if path in allowed:
                continue
            bad = [n for n in _imports(path) if n.startswith("transformers.models")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}: go through fastdecode/model.py"
