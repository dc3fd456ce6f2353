"""Who a model and a tokenizer are: the identities that caches, trajectories and adapters are checked against.

- ``tokenizer_fingerprint``: sha256 over the vocabulary, so two tokenizers with the same hash map every token
  to the same id, whatever path they were loaded from.
- ``model_identity``: the id a manifest stores for a ``ModelConfig`` (hub id / path, or the random-init seed).
- ``weights_fingerprint``: sha256 over every parameter's name, shape and a sample of its values rounded to
  bf16 (an fp32 and a bf16 load of the same weights agree; any fine-tune changes it); ``SAMPLE`` values read.
- ``load_identity``: what that leaves out and a timing depends on: dtypes, attention, library versions.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from typing import Any

import torch

from fastdecode.runtime.gguf_blocks import shipped

SAMPLE = 4096


def tokenizer_fingerprint(tokenizer: Any) -> dict:
    """``{"name", "vocab_size", "vocab_hash"}``: sha256 over the sorted (token, id) pairs of the vocabulary.

    Two tokenizers with the same hash map every token to the same id, whatever path they were loaded from.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return {"name": name, "vocab_size": len(vocab), "vocab_hash": digest}


def model_identity(model_cfg: Any) -> str:
    """The model id stored in a manifest for a ``ModelConfig``: hub id / path, or ``random:<name>:<seed>``."""
    if model_cfg.source == "random":
        return f"random:{model_cfg.name}:{model_cfg.seed}"
    return model_cfg.name_or_path or model_cfg.name


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module, full: bool = False) -> str:
    """sha256 of ``model``'s parameters (names, shapes, sampled values rounded to bf16); ``full=True`` hashes
    every value exactly (bitwise checks, e.g. "training left the base model untouched")."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = param.detach().reshape(-1)
        digest.update(f"{name}:{tuple(param.shape)}".encode())
        if full:
            digest.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
            continue
        if flat.numel() > SAMPLE:
            steps = torch.arange(SAMPLE, dtype=torch.long, device=flat.device)
            index = steps * (flat.numel() - 1) // (SAMPLE - 1)  # integers: exact, last element included
            flat = flat[index]
        values = flat.float().to(torch.bfloat16).cpu().contiguous().view(torch.int16)
        digest.update(values.numpy().tobytes())
    return digest.hexdigest()


def weights_key(model: torch.nn.Module) -> str:
    """A name for ``model``'s weights that reads none of them where it can: for a model unchanged since it was
    dequantised from a GGUF (``gguf_blocks.shipped``), that file's content digest (sampling would page in all
    the float weights the 4-bit path never reads); else ``weights_fingerprint``. For keys of measurements
    (the cost store), not for identities stored beside trained files (those keep ``weights_fingerprint``)."""
    found = shipped(model)
    if found is not None and found.state() == found.loaded:
        return hashlib.sha256(f"gguf:{found.digest}".encode()).hexdigest()
    return weights_fingerprint(model)


def package_version(name: str) -> str:
    """The installed version of the distribution ``name`` (``unknown`` when it is not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def load_identity(model: torch.nn.Module) -> str:
    """What a timing of ``model`` depends on besides its weights (``weights_fingerprint`` rounds them to bf16,
    so an fp32 and a bf16 load share it), the machine and the engine: its parameters' dtypes, its attention
    implementation (Hugging Face's ``config._attn_implementation``) and the torch, transformers and
    fastdecode versions. One string, ``dtype=bfloat16|attn=sdpa|torch=...,transformers=...,fastdecode=...``."""
    dtypes = "+".join(sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}))
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    versions = ",".join(f"{name}={package_version(name)}" for name in ("torch", "transformers", "fastdecode"))
    return f"dtype={dtypes}|attn={attn}|{versions}"
