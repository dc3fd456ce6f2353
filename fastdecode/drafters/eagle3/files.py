"""EAGLE-3 head checkpoints in the two public dialects, written together and read either way.

``save_eagle3`` writes one directory in the speculators dialect (what ``vllm serve`` reads) and, in its
``sglang/`` subfolder, the dialect of SGLang and SpecForge, unless the head uses a setting SGLang does not
implement (``sglang_unsupported``); each dialect's feature-layer ids in its engine's convention
(``sglang_layer_ids``). ``load_eagle3`` and ``read_eagle3_config`` read either dialect, told apart by
``architectures``, and refuse a foreign or damaged directory with ``Eagle3FileError`` naming the file.
Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fastdecode.config import ConfigError
from fastdecode.drafters.eagle3.model import Eagle3Config, Eagle3Head, rope_theta_of, vocab_maps_agree
from fastdecode.files.checkpoint import CheckpointError
from fastdecode.files.drafter_dir import CONFIG_FILE, WEIGHTS_FILE, check_state, read_config_json
from fastdecode.files.io import atomic_directory

log = logging.getLogger(__name__)

SGLANG_DIR = "sglang"
SPECULATORS_ARCHITECTURES = ("Eagle3DraftModel", "Eagle3Speculator")
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_PREFIX, SGLANG_LAYER_PREFIX = "layers.0.", "midlayer."
OPTIONAL_WEIGHTS = ("embed_tokens.weight",)  # speculators may save the verifier's embedding; not ours
SGLANG_ID_SHIFT = 1  # SGLang's explicit feature id k is hidden_states[k + 1] (sglang_layer_ids)


class Eagle3FileError(CheckpointError):
    """A directory that is not a readable EAGLE-3 head; the message names the file and the fix."""


def llama_layer_config(cfg: Eagle3Config) -> dict[str, Any]:
    """The one-layer Llama config both dialects describe the head's layer with (``vocab_size``: the
    target's)."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def speculators_config(cfg: Eagle3Config, verifier_name: str, speculative_tokens: int) -> dict[str, Any]:
    """``config.json`` of the speculators / vLLM dialect."""
    greedy = {"proposal_type": "greedy", "speculative_tokens": speculative_tokens}
    return {
        "architectures": [SPECULATORS_ARCHITECTURES[0]],
        "model_type": "speculators",
        "speculators_model_type": "eagle3",
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": False,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "transformer_layer_config": llama_layer_config(cfg),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{**greedy, "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_name, "architectures": list(cfg.target_architectures)},
        },
    }


def sglang_layer_ids(ids: Sequence[int]) -> list[int]:
    """Our feature ids (Hugging Face ``hidden_states[i]``, what vLLM and the speculators dialect use
    unchanged) as SGLang's ``eagle_aux_hidden_state_layer_ids``: ``i - 1``. SGLang's
    ``set_eagle3_layers_to_capture`` (sgl-project/sglang ``python/sglang/srt/models/llama.py``) captures an
    explicit id ``k`` before layer ``k + 1``, "the output of the (i-1)th layer": ``hidden_states[k + 1]``;
    SpecForge writes ``[1, L // 2 - 1, L - 4]`` for our default ``[2, L // 2, L - 3]``."""
    return [i - SGLANG_ID_SHIFT for i in ids]


def layer_ids_from_sglang(ids: Sequence[int]) -> list[int]:
    """SGLang's ``eagle_aux_hidden_state_layer_ids`` as our ``hidden_states`` indices: ``k + 1``."""
    return [k + SGLANG_ID_SHIFT for k in ids]


def sglang_config(cfg: Eagle3Config) -> dict[str, Any]:
    """``sglang/config.json``: the flat Llama config SGLang and SpecForge read (feature ids minus one)."""
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        **llama_layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(cfg.aux_layer_ids)},
    }


def unserved_options(cfg: Eagle3Config) -> list[str]:
    """``fc_norm`` / ``norm_before_fc`` where ``cfg`` turns them on: no serving engine runs them (vLLM's
    EAGLE-3 loader does not honour either field, SGLang has neither module), so only fastdecode decodes such
    a head as trained."""
    return [f"{name}=true" for name in ("fc_norm", "norm_before_fc") if getattr(cfg, name)]


def sglang_unsupported(cfg: Eagle3Config) -> list[str]:
    """What of ``cfg`` SGLang's ``LlamaForCausalLMEagle3`` cannot serve as trained (empty: it can).

    Its layer always takes the residual from the raw fused feature (``norm_before_residual`` false), it has
    no ``fc_norm`` or ``input_norm`` module, whose weights its ``load_weights`` would skip silently, and it
    cannot capture feature id 0 (the embedding output): that is SGLang id -1, whose capture before layer 0
    adds a residual that does not exist yet. Id 0 is refused here, for the ``sglang/`` export only, rather
    than by ``Eagle3Config``: vLLM and fastdecode read it right, so such a head (e.g. a speculators
    checkpoint) keeps its speculators directory; ``recipe=eagle3`` never trains it (ids from 1)."""
    found = [
        f"{name}=true" for name in ("norm_before_residual", "fc_norm", "norm_before_fc") if getattr(cfg, name)
    ]
    if 0 in cfg.aux_layer_ids:
        found.append(f"feature id 0 (the embedding output) of aux_layer_ids={list(cfg.aux_layer_ids)}")
    return found


def _renamed(state: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in state.items()}


def _write(folder: Path, config: dict[str, Any], state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    folder.mkdir(exist_ok=True)
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})


def save_eagle3(
    head: Eagle3Head,
    cfg: Eagle3Config,
    out_dir: str | os.PathLike,
    *,
    verifier_name: str,
    speculative_tokens: int = 3,
    in_place: bool = False,
) -> Path:
    """Write ``head`` to ``out_dir`` (speculators dialect) and ``out_dir/sglang`` (SGLang dialect, only when
    ``sglang_unsupported(cfg)`` is empty), as one atomic directory; ``verifier_name``: the target's hub id
    or path, as the server should load it. ``in_place``: write into the existing ``out_dir`` directly (it is
    itself a staging directory that its caller renames as a whole, e.g. a training run's ``final/``)."""
    if cfg != head.config:
        raise ValueError("cfg is not the configuration the head was built with")
    if speculative_tokens < 1:
        raise ConfigError(f"speculative_tokens={speculative_tokens}: give at least 1")
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    dtype = head.fc.weight.dtype
    unsupported = _warn_unserved(cfg, Path(out_dir))

    def write(folder: Path) -> None:
        _write(folder, speculators_config(cfg, verifier_name, speculative_tokens), state, dtype)
        if not unsupported:
            sglang_state = _renamed(state, LAYER_PREFIX, SGLANG_LAYER_PREFIX)
            _write(folder / SGLANG_DIR, sglang_config(cfg), sglang_state, dtype)

    if in_place:
        write(Path(out_dir))
    else:
        with atomic_directory(out_dir) as tmp:
            write(tmp)
    return Path(out_dir)


def _warn_unserved(cfg: Eagle3Config, out_dir: Path) -> list[str]:
    """Warn of what the engines cannot serve in ``cfg``; return ``sglang_unsupported(cfg)``."""
    unserved = unserved_options(cfg)
    if unserved:
        log.warning(
            "%s: vLLM and SGLang cannot run %s (vLLM's EAGLE-3 loader does not honour the field, SGLang has "
            "no such module), so neither serves this head as trained: only fastdecode decodes it correctly. "
            "Train with those options off to serve it with an engine",
            out_dir,
            ", ".join(unserved),
        )
    unsupported = sglang_unsupported(cfg)
    if unsupported:
        log.warning(
            "not writing %s: SGLang's LlamaForCausalLMEagle3 cannot serve %s and would serve the head "
            "computing something else; the speculators directory is written. Train with those options off "
            "(and feature ids >= 1) to serve with SGLang",
            out_dir / SGLANG_DIR,
            ", ".join(unsupported),
        )
    return unsupported


def _read_config(folder: Path) -> dict[str, Any]:
    return read_config_json(
        folder / CONFIG_FILE,
        Eagle3FileError,
        f"{folder} is not an EAGLE-3 head; give the directory save_eagle3 wrote (or its {SGLANG_DIR}/ subfolder)",
        "write the head again with save_eagle3",
    )


def _field(config: dict[str, Any], key: str, path: Path) -> Any:
    if config.get(key) is None:
        raise Eagle3FileError(f"{path} has no {key!r}: write the head again with save_eagle3")
    return config[key]


def _norm_before_residual(config: dict[str, Any], path: Path, sglang: bool) -> bool:
    if "norm_before_residual" in config or sglang:  # SGLang and SpecForge have only the false layer
        return bool(config.get("norm_before_residual", False))
    log.warning(
        "%s has no norm_before_residual: reading it as false (the speculators default); vLLM would assume "
        "true, so this head drafts differently there. Write the key to say which it was trained with",
        path,
    )
    return False


def config_from_files(config: dict[str, Any], path: Path) -> Eagle3Config:
    """The ``Eagle3Config`` a ``config.json`` of either dialect describes (``path``: named in errors)."""
    arch = (config.get("architectures") or [None])[0]
    if arch in SPECULATORS_ARCHITECTURES and config.get("speculators_model_type") == "eagle3":
        layer = _field(config, "transformer_layer_config", path)
        aux = _field(config, "eagle_aux_hidden_state_layer_ids", path)
    elif arch == SGLANG_ARCHITECTURE:
        layer = config
        aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if not isinstance(aux, list) or not all(isinstance(k, int) for k in aux):
            raise Eagle3FileError(
                f"{path} has no list of integers eagle_config.eagle_aux_hidden_state_layer_ids: add the "
                "target's feature layer ids in SGLang's convention (hidden_states index minus one; "
                "SpecForge's default [1, L // 2 - 1, L - 4]) or write the head again with save_eagle3"
            )
        aux = layer_ids_from_sglang(aux)
    else:
        raise Eagle3FileError(
            f"{path}: architectures {config.get('architectures')} is not an EAGLE-3 head (expected "
            f"{SPECULATORS_ARCHITECTURES[0]} with speculators_model_type eagle3, or {SGLANG_ARCHITECTURE})"
        )
    if not isinstance(layer, dict):
        raise Eagle3FileError(f"{path}: transformer_layer_config is not a JSON object; write the head again")
    if layer.get("num_hidden_layers", 1) != 1 or layer.get("hidden_act", "silu") != "silu":
        raise Eagle3FileError(f"{path}: only one-layer SiLU heads are supported, not {layer}")
    hidden, heads = _field(layer, "hidden_size", path), _field(layer, "num_attention_heads", path)
    target_arch = ((config.get("speculators_config") or {}).get("verifier") or {}).get("architectures")
    try:
        return Eagle3Config(
            hidden_size=hidden,
            target_hidden_size=config.get("target_hidden_size") or hidden,
            num_attention_heads=heads,
            num_key_value_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or hidden // heads,
            intermediate_size=_field(layer, "intermediate_size", path),
            vocab_size=_field(layer, "vocab_size", path),
            draft_vocab_size=config.get("draft_vocab_size") or layer["vocab_size"],
            aux_layer_ids=list(aux),
            rms_norm_eps=layer.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta_of(SimpleNamespace(**layer)),
            max_position_embeddings=layer.get("max_position_embeddings", 2048),
            norm_before_residual=_norm_before_residual(config, path, arch == SGLANG_ARCHITECTURE),
            fc_norm=bool(config.get("fc_norm", False)),
            norm_before_fc=bool(config.get("norm_before_fc", False)),
            target_architectures=list(target_arch or []),
        )
    except (ConfigError, TypeError) as err:
        raise Eagle3FileError(f"{path}: {err}; write the head again with save_eagle3") from err


def _read_weights(folder: Path, sglang: bool) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise Eagle3FileError(f"{path}: no such file; write the head again with save_eagle3")
    try:
        state = load_file(str(path))
    except SafetensorError as err:  # a damaged header or payload
        raise Eagle3FileError(f"{path} is damaged ({err}): write the head again with save_eagle3") from err
    state = {k.removeprefix("model."): v for k, v in state.items() if k not in OPTIONAL_WEIGHTS}
    return _renamed(state, SGLANG_LAYER_PREFIX, LAYER_PREFIX) if sglang else state


def _check_weights(head: Eagle3Head, state: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse missing, unexpected or misshapen tensors, and vocabulary maps that contradict each other."""
    expected = head.state_dict()
    cfg = head.config
    if "d2t" not in state and "t2d" not in state and cfg.draft_vocab_size == cfg.vocab_size:
        state.update(d2t=expected["d2t"], t2d=expected["t2d"])  # no draft vocabulary: the identity
    check_state(expected, state, path, Eagle3FileError, "write the head again with save_eagle3")
    if not vocab_maps_agree(state["d2t"], state["t2d"]):
        raise Eagle3FileError(
            f"{path / WEIGHTS_FILE}: d2t and t2d describe different draft vocabularies; write the head "
            "again with save_eagle3"
        )


def read_eagle3_config(path: str | os.PathLike) -> Eagle3Config:
    """The configuration of the head saved in ``path`` (either dialect), read without its weights: what a
    decoder checks against its target before anything loads."""
    folder = Path(path)
    return config_from_files(_read_config(folder), folder / CONFIG_FILE)


def load_eagle3(path: str | os.PathLike) -> tuple[Eagle3Head, Eagle3Config]:
    """The head saved in ``path``, in either dialect (``save_eagle3``'s directory, its ``sglang/``
    subfolder, or a checkpoint of speculators or SpecForge), in the dtype of its weights."""
    folder = Path(path)
    config = _read_config(folder)
    cfg = config_from_files(config, folder / CONFIG_FILE)
    state = _read_weights(folder, sglang=config["architectures"][0] == SGLANG_ARCHITECTURE)
    head = Eagle3Head(cfg)
    _check_weights(head, state, folder)
    head.to(state["fc.weight"].dtype)
    own = head.state_dict()  # once: its dtypes (d2t, t2d keep theirs)
    head.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    return head, cfg
