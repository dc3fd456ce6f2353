"""fastdecode: train LLMs for faster generation and decode losslessly with the speed they learnt.

    import fastdecode
    fd = fastdecode.from_pretrained("tiny-llama")     # a checkpoint directory, a hub id or a configs/model name
    out = fd.generate("Hello", max_new_tokens=16)      # method="auto": the plan the cost model expects to pay

The API (``fastdecode/api.py``) loads on first use, so ``import fastdecode.config`` does not wait for torch.
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
