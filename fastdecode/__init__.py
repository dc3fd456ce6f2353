"""fastdecode: train LLMs for faster generation and decode losslessly with the speed they learnt.

The library API (``fastdecode/api.py``)::

    import fastdecode
    fd = fastdecode.from_pretrained("tiny-llama")         # a checkpoint directory, a hub id or a configs/model name
    out = fd.generate("Hello", max_new_tokens=16, method="self_speculative", exit_layer=2)
    print(out.text, out.acceptance, out.layers_per_token)

The names below load on first use, so ``import fastdecode.config`` (the entry points' ``--help``) does not
wait for torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = ("from_pretrained", "FastDecoder", "GenerationResult", "ALIASES", "__version__")
__all__ = list(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("fastdecode.api"), name)
    raise AttributeError(f"module 'fastdecode' has no attribute {name!r}")
