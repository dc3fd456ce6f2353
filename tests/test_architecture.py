"""Layering rules of docs/ARCHITECTURE.md, checked on the source: imports only point down."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINING = {"layerskip_train", "cllm_train", "skipdecode_train", "adapter_train"}
ENTRY = {"fastdecode_cli", "eval"}
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


def test_only_the_adapter_imports_hf_modeling_code():
    """HF model internals (transformers.models.*) are touched by fastdecode/model.py alone."""
    allowed = {ROOT / "fastdecode" / "model.py"}
    for package in FORBIDDEN:
        for path in _sources(package):
            if path in allowed:
                continue
            bad = [n for n in _imports(path) if n.startswith("transformers.models")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}: go through fastdecode/model.py"
