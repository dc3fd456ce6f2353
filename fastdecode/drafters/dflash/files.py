"""DFlash drafter checkpoints in the two public formats, written together and read either way.

``save_dflash`` writes the native format (``DFlashDraftModel``: what vLLM ``method: "dflash"``, SGLang
``--speculative-algorithm DFLASH`` and llama.cpp's GGUF converter read) and, given the target's embedding and
head (``Verifier``), the speculators format in its ``speculators/`` subfolder. ``load_dflash`` and
``read_dflash_config`` read either, told apart by ``architectures``; the layer-id conventions of the engines are
``capture_layer_ids``/``reference_layer_ids``. A foreign, inconsistent or damaged directory is refused by name
(``DFlashFileError``). Design notes: docs/design/dflash.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fastdecode.config import ConfigError
from fastdecode.drafters.dflash.layer import DFlashDraft
from fastdecode.drafters.dflash.model import DFlashConfig
from fastdecode.files.checkpoint import CheckpointError
from fastdecode.files.drafter_dir import CONFIG_FILE, WEIGHTS_FILE, check_state, read_config_json
from fastdecode.files.io import atomic_directory

NATIVE_ARCHITECTURE = "DFlashDraftModel"
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"
SPECULATORS_DIR = "speculators"  # save_dflash's subfolder in the speculators format
# the speculators format's copies of the target's embedding and head
VERIFIER_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
FASTDECODE_KEY = "fastdecode"  # what only fastdecode reads: the target's architectures and tied head
# an engine's capture id k = Hugging Face hidden_states[k] = the output of decoder layer k - 1
CAPTURE_SHIFT = 1
# Qwen3Config's defaults: a speculators transformer_layer_config may be a diff dict that omits them
QWEN3_DEFAULTS = {"head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e4, "max_positions": 32768}


class DFlashFileError(CheckpointError):
    """A directory that is not a readable DFlash drafter; the message names the file and the fix."""


def capture_layer_ids(ids: Sequence[int]) -> list[int]:
    """Reference ids (``dflash_config.target_layer_ids``: id ``i`` = the output of decoder layer ``i``, what
    z-lab's ``extract_context_feature`` reads as ``hidden_states[i + 1]`` and SGLang reads unchanged) -> the
    capture ids ``i + 1`` (the residual stream entering layer ``i + 1``). Capture ids are what vLLM's
    ``eagle_aux_hidden_state_layer_ids`` (used verbatim; without it vLLM adds the 1 itself, vllm#40727), the
    speculators format's ``aux_hidden_state_layer_ids``, llama.cpp's GGUF ``dflash.target_layers`` (its
    converter adds the 1) and fastdecode's ``DFlashConfig.feature_ids`` hold."""
    return [int(i) + CAPTURE_SHIFT for i in ids]


def reference_layer_ids(ids: Sequence[int]) -> list[int]:
    """Capture ids (``capture_layer_ids``) -> reference ids: ``k - 1``."""
    return [int(k) - CAPTURE_SHIFT for k in ids]


@dataclass
class Verifier:
    """What the speculators format copies from the target: its name or path as a server should load it, its
    architectures, and its (frozen) input embedding and output head, each ``[vocab, hidden]`` (a tied
    target's head is its embedding)."""

    name_or_path: str
    embed_tokens: torch.Tensor
    lm_head: torch.Tensor
    architectures: list[str] = field(default_factory=list)


def layer_config(cfg: DFlashConfig) -> dict[str, Any]:
    """The Qwen3 config of the draft layers, shared by both formats (RoPE explicit: vLLM's DFlash loader
    assumes ``rope_theta`` 1e6 without it, and a wrong base collapses acceptance silently)."""
    return {
        "model_type": "qwen3",
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_target_layers,
    }


def fastdecode_fields(cfg: DFlashConfig, speculative_tokens: int) -> dict[str, Any]:
    """What no engine reads: the target's architectures and tied head (checked against a target) and the
    drafts per round the drafter was trained to serve (an engine's ``num_speculative_tokens``)."""
    return {
        "target_architectures": list(cfg.target_architectures),
        "target_tie_word_embeddings": cfg.tie_word_embeddings,
        "speculative_tokens": speculative_tokens,
    }


def native_config(cfg: DFlashConfig, speculative_tokens: int) -> dict[str, Any]:
    """``config.json`` of the native format: the reference drafts' keys, ``block_size`` at the top and in
    ``dflash_config`` (loaders read either), plus vLLM's capture ids written out (``capture_layer_ids``), so
    every vLLM version reads the same layers whether or not it adds the 1 itself."""
    return {
        "architectures": [NATIVE_ARCHITECTURE],
        **layer_config(cfg),
        "block_size": cfg.block_size,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size,
        },
        "eagle_aux_hidden_state_layer_ids": capture_layer_ids(cfg.target_layer_ids),
        "target_hidden_size": cfg.target_hidden_size,
        FASTDECODE_KEY: fastdecode_fields(cfg, speculative_tokens),
    }


def speculators_config(cfg: DFlashConfig, verifier: Verifier, speculative_tokens: int) -> dict[str, Any]:
    """``speculators/config.json`` (speculators' ``DFlashSpeculatorConfig``). ``sliding_window_non_causal``
    is true although no layer slides: vLLM maps it to ``dflash_config.causal = not it`` for every layer
    (``update_dflash``), so false would serve the non-causal block causally."""
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "model_type": "speculators",
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer_config(cfg),
        "draft_vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.target_hidden_size,
        "aux_hidden_state_layer_ids": capture_layer_ids(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {
                "name_or_path": verifier.name_or_path,
                "architectures": list(verifier.architectures),
            },
        },
        FASTDECODE_KEY: fastdecode_fields(cfg, speculative_tokens),
    }


def verifier_weights(cfg: DFlashConfig, verifier: Verifier) -> dict[str, torch.Tensor]:
    """The target's embedding and head as the speculators format stores them, checked against ``cfg``."""
    shape = (cfg.vocab_size, cfg.hidden_size)
    tensors = {"embed_tokens.weight": verifier.embed_tokens, "lm_head.weight": verifier.lm_head}
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shape:
            raise ConfigError(
                f"the verifier's {name} is {tuple(tensor.shape)}, not [vocab_size, hidden_size] = {shape} of "
                "the drafter: give the target the drafter was trained for"
            )
    return {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}


def _write(folder: Path, config: dict[str, Any], state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    folder.mkdir(exist_ok=True)
    name = str(dtype).removeprefix("torch.")
    config = {**config, "dtype": name, "torch_dtype": name}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})


def save_dflash(
    draft: DFlashDraft,
    out_dir: str | os.PathLike,
    *,
    speculators: Verifier | None = None,
    speculative_tokens: int | None = None,
    in_place: bool = False,
) -> Path:
    """Write ``draft`` to ``out_dir`` in the native format and, with ``speculators`` (the target's
    embedding and head), to ``out_dir/speculators`` in the speculators format, as one atomic directory.
    ``speculative_tokens``: the drafts per round to advertise (1 .. B - 1; None: B - 1). ``in_place``: into
    the existing ``out_dir``, itself a staging directory its caller renames (e.g. a training run's
    ``final/``)."""
    cfg = draft.config
    k = cfg.block_size - 1 if speculative_tokens is None else int(speculative_tokens)
    if not 1 <= k < cfg.block_size:
        raise ConfigError(
            f"speculative_tokens={speculative_tokens} is outside 1 .. block_size - 1 = {cfg.block_size - 1}: "
            "a block drafts at most B - 1 tokens"
        )
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    dtype = draft.fc.weight.dtype
    extra = verifier_weights(cfg, speculators) if speculators is not None else {}

    def write(folder: Path) -> None:
        _write(folder, native_config(cfg, k), state, dtype)
        if speculators is not None:
            own = {k: v.to(dtype) for k, v in extra.items()}
            _write(folder / SPECULATORS_DIR, speculators_config(cfg, speculators, k), {**state, **own}, dtype)

    if in_place:
        write(Path(out_dir))
    else:
        with atomic_directory(out_dir) as tmp:
            write(tmp)
    return Path(out_dir)


def _read_json(folder: Path) -> dict[str, Any]:
    return read_config_json(
        folder / CONFIG_FILE,
        DFlashFileError,
        f"{folder} is not a DFlash drafter; give the directory save_dflash (recipe=dflash's final/) wrote, or "
        f"its {SPECULATORS_DIR}/ subfolder",
        "write the drafter again",
    )


def _check_layers(layer: dict[str, Any], inner: dict[str, Any], path: Path) -> None:
    """Refuse what ``DFlashDraft`` does not compute: sliding or causal layers, biases, another activation."""
    kinds = set(layer.get("layer_types") or ["full_attention"])
    causal = inner.get("causal", layer.get("is_causal"))
    if kinds != {"full_attention"} or causal or layer.get("use_sliding_window"):
        raise DFlashFileError(
            f"{path}: layer_types {sorted(kinds)}, causal={causal}: fastdecode's DFlash drafter runs full, "
            "non-causal attention only; use a drafter without sliding-window or causal layers"
        )
    if layer.get("attention_bias") or layer.get("hidden_act", "silu") != "silu":
        raise DFlashFileError(
            f"{path}: attention_bias={layer.get('attention_bias')}, hidden_act={layer.get('hidden_act')}: "
            "fastdecode's DFlash drafter has no biases and a SiLU MLP"
        )


def _build(layer: dict[str, Any], config: dict[str, Any], values: dict[str, Any], path: Path) -> DFlashConfig:
    """A ``DFlashConfig`` from a Qwen3 layer config, the file's top level and the DFlash ``values`` (each
    named in the error when absent)."""
    absent = [k for k, v in values.items() if v is None]
    if absent:
        raise DFlashFileError(f"{path} has no {absent}: write the drafter again (save_dflash writes them)")
    ours = config.get(FASTDECODE_KEY) or {}
    rope = (layer.get("rope_parameters") or {}).get("rope_theta") or layer.get("rope_theta")
    try:
        heads = layer["num_attention_heads"]
        return DFlashConfig(
            hidden_size=layer["hidden_size"],
            num_hidden_layers=layer["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or QWEN3_DEFAULTS["head_dim"],
            intermediate_size=layer["intermediate_size"],
            vocab_size=layer["vocab_size"],
            rms_norm_eps=layer.get("rms_norm_eps", QWEN3_DEFAULTS["rms_norm_eps"]),
            rope_theta=rope or QWEN3_DEFAULTS["rope_theta"],
            max_position_embeddings=layer.get("max_position_embeddings", QWEN3_DEFAULTS["max_positions"]),
            target_hidden_size=config.get("target_hidden_size"),
            tie_word_embeddings=bool(ours.get("target_tie_word_embeddings", False)),
            **values,
        )
    except (KeyError, TypeError) as err:
        raise DFlashFileError(f"{path} lacks {err} or has a wrong type: write the drafter again") from err
    except ConfigError as err:
        raise DFlashFileError(f"{path}: {err}") from err


def config_from_native(config: dict[str, Any], path: Path) -> DFlashConfig:
    """A native ``config.json`` -> ``DFlashConfig`` (``block_size`` inside ``dflash_config`` or at the top; an
    ``eagle_aux_hidden_state_layer_ids`` that contradicts the reference ids refused: vLLM would read it)."""
    inner = config.get("dflash_config") or {}
    _check_layers(config, inner, path)
    ids, aux = inner.get("target_layer_ids"), config.get("eagle_aux_hidden_state_layer_ids")
    if aux and ids is not None and list(aux) != capture_layer_ids(ids):
        raise DFlashFileError(
            f"{path}: eagle_aux_hidden_state_layer_ids {list(aux)} (what vLLM captures) are not "
            f"dflash_config.target_layer_ids {list(ids)} + 1 (what SGLang and the reference read): the engines "
            "would feed the drafter different layers; write the drafter again"
        )
    values = {
        "target_layer_ids": list(ids) if ids is not None else None,
        "num_target_layers": config.get("num_target_layers"),
        "mask_token_id": inner.get("mask_token_id", config.get("mask_token_id")),
        "block_size": inner.get("block_size", config.get("block_size")),
        "target_architectures": list((config.get(FASTDECODE_KEY) or {}).get("target_architectures", [])),
    }
    return _build(config, config, values, path)


def config_from_speculators(config: dict[str, Any], path: Path) -> DFlashConfig:
    """A speculators ``config.json`` -> ``DFlashConfig`` (aux ids mapped back, ``reference_layer_ids``). A
    checkpoint converted elsewhere does not record the target's depth: read as the least one its ids fit."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DFlashFileError(
            f"{path}: transformer_layer_config is not a JSON object; write the drafter again"
        )
    _check_layers(layer, {}, path)
    if config.get("sample_from_anchor") or config.get("projector_type", "dflash") != "dflash":
        raise DFlashFileError(
            f"{path}: sample_from_anchor={config.get('sample_from_anchor')}, projector_type="
            f"{config.get('projector_type')}: only plain DFlash (slot k drafts the token at anchor + k) is read"
        )
    vocab = layer.get("vocab_size")
    if config.get("draft_vocab_size", vocab) != vocab:
        raise DFlashFileError(
            f"{path}: draft_vocab_size {config.get('draft_vocab_size')} is not the target's vocabulary {vocab}: "
            "a reduced draft vocabulary (d2t) is not supported; train the drafter on the full vocabulary"
        )
    aux = config.get("aux_hidden_state_layer_ids")
    ids = reference_layer_ids(aux) if isinstance(aux, list) and aux else None
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    values = {
        "target_layer_ids": ids,
        "num_target_layers": layer.get("num_target_layers") or (max(ids) + 2 if ids else None),
        "mask_token_id": config.get("mask_token_id"),
        "block_size": config.get("block_size"),
        "target_architectures": list(verifier.get("architectures") or []),
    }
    return _build(layer, config, values, path)


def config_from_files(config: dict[str, Any], path: Path) -> DFlashConfig:
    """The ``DFlashConfig`` a ``config.json`` of either format describes (``path``: named in errors)."""
    arch = (config.get("architectures") or [None])[0]
    if arch == NATIVE_ARCHITECTURE:
        return config_from_native(config, path)
    if arch == SPECULATORS_ARCHITECTURE and config.get("speculators_model_type") == "dflash":
        return config_from_speculators(config, path)
    raise DFlashFileError(
        f"{path}: architectures {config.get('architectures')} is not a DFlash drafter (expected "
        f"{NATIVE_ARCHITECTURE}, or {SPECULATORS_ARCHITECTURE} with speculators_model_type dflash): give a "
        "DFlash drafter's directory"
    )


def read_dflash_config(path: str | os.PathLike) -> DFlashConfig:
    """The configuration of the drafter in ``path`` (either format), read without its weights."""
    folder = Path(path)
    return config_from_files(_read_json(folder), folder / CONFIG_FILE)


def _read_weights(folder: Path, cfg: DFlashConfig) -> dict[str, torch.Tensor]:
    """The drafter's tensors (a ``model.`` prefix dropped); the verifier's copies checked for shape, dropped."""
    weights = folder / WEIGHTS_FILE
    try:
        state = {k.removeprefix("model."): v for k, v in load_file(str(weights)).items()}
    except (FileNotFoundError, SafetensorError) as err:
        raise DFlashFileError(f"{weights} is missing or damaged ({err}): write the drafter again") from err
    shape = (cfg.vocab_size, cfg.hidden_size)
    wrong = [
        f"{k} {tuple(state[k].shape)}" for k in VERIFIER_WEIGHTS if k in state and state[k].shape != shape
    ]
    if wrong:
        raise DFlashFileError(
            f"{weights}: the verifier's {wrong} are not [vocab_size, hidden_size] = {shape}: write the drafter again"
        )
    return {k: v for k, v in state.items() if k not in VERIFIER_WEIGHTS}


def load_dflash(path: str | os.PathLike) -> tuple[DFlashDraft, DFlashConfig]:
    """The drafter saved in ``path`` (either format), in the dtype of its weights; missing, unexpected or
    misshapen tensors refused by name."""
    folder = Path(path)
    cfg = read_dflash_config(folder)
    state = _read_weights(folder, cfg)
    draft = DFlashDraft(cfg)
    expected = draft.state_dict()
    check_state(expected, state, folder, DFlashFileError, "write the drafter again")
    draft.to(state["fc.weight"].dtype)
    draft.load_state_dict(state)
    return draft, cfg
