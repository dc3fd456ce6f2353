"""What every trained drafter's directory shares (EAGLE-3 heads, DFlash drafters): its ``config.json`` read or
refused by name (``read_config_json``), the error when none is named (``drafter_needed``), the refusal of one
built for another target (``check_fit``), and its weights loaded once per model, device, dtype and version of
its files (``load_once``), its weights checked against its config (``check_state``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastdecode.config import ConfigError
from fastdecode.files.file_cache import FileCache

CONFIG_FILE = "config.json"  # a drafter directory's config, in every format
WEIGHTS_FILE = "model.safetensors"  # and its weights


def read_config_json(path: Path, error: type[Exception], missing: str, rewrite: str) -> dict[str, Any]:
    """The JSON object in ``path``; else ``error`` naming the file and, for a missing file, ``missing`` (what
    the directory is not, and which to give), for a damaged one ``rewrite`` (how to write it again)."""
    if not path.is_file():
        raise error(f"{path}: no such file, so {missing}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"{path} is not valid JSON ({err}): {rewrite}") from err
    if not isinstance(config, dict):
        raise error(f"{path} holds no JSON object: {rewrite}")
    return config


def drafter_needed(decoder: str, what: str, recipe: str, others: str) -> ConfigError:
    """The error of decoder ``decoder`` run without ``decoder.drafter``: names the setting, the recipe that
    writes ``what`` and the other checkpoints it reads."""
    return ConfigError(
        f"decoder '{decoder}' needs decoder.drafter=PATH (Python: from_pretrained(..., drafter=PATH) or "
        f"generate(..., drafter=PATH)): the directory of {what} trained for this model (`python train.py "
        f"recipe={recipe}` writes one to <run>/final), or {others}."
    )


def check_fit(found: dict[str, tuple[Any, Any]], where: str, what: str) -> None:
    """Refuse a drafter built for another target: ``found`` maps a property to ``(the drafter's, the
    model's)``; the first that differs is named, with ``where`` (the setting) and ``what`` the drafter is."""
    for name, (drafter, model) in found.items():
        if drafter != model:
            raise ConfigError(
                f"{where} is {what} for a target of {name} {drafter}, but this model has {model}: give one "
                "trained for this model."
            )


def load_once(
    cache: FileCache,
    path: str,
    files: list[str],
    m: Any,
    *,
    read: Callable[[str], tuple[Any, Any]],
    check: Callable[[Any, Any, str], None],
) -> Any:
    """The drafter in ``path``: ``read(path)`` -> ``(module, config)``, ``check(config, m, path)``, then on
    ``m``'s device and dtype, in eval mode, frozen; kept in ``cache`` per model (``m`` owns the entry), device,
    dtype and version of ``path``'s ``files``."""

    def load() -> Any:
        module, cfg = read(path)
        check(cfg, m, path)
        return module.to(device=m.device, dtype=m.dtype).eval().requires_grad_(False)

    paths = [Path(path) / name for name in files]
    return cache.get(paths, load, key=(str(m.device), str(m.dtype)), owner=m)


def check_state(
    expected: dict[str, Any], state: dict[str, Any], folder: Path, error: type[Exception], rewrite: str
):
    """Refuse ``state`` (the weights file's tensors) unless it has exactly ``expected``'s names and shapes:
    ``error`` names the missing, unexpected and misshapen tensors, and ``rewrite`` the fix."""
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [
        f"{k} {tuple(state[k].shape)} (expected {tuple(v.shape)})"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or extra or wrong:
        raise error(
            f"{folder / WEIGHTS_FILE} does not match {folder / CONFIG_FILE}: missing {missing}, "
            f"unexpected {extra}, misshapen {wrong}; {rewrite}"
        )
