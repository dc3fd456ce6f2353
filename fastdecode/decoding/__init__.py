"""Decoding strategies: free functions over the model (``EarlyExitModel``) and its explicit KV cache, one strategy per module.

Every strategy has the same signature, so callers (eval, benchmarks) pick one by name::

    out = get_decoder("self_speculative")(m, prompts, DecodeConfig(max_new_tokens=64, exit_layer=8))

``m`` is an ``EarlyExitModel``; ``prompts`` a list of token-id lists (any lengths, batched with left
padding); ``draft`` a separate drafter model for two-model strategies (None for the others). Options of one
decoder are nested in ``DecodeConfig`` under its name: ``DecodeConfig(..., jacobi=JacobiOptions(block=8))``.
"""

from __future__ import annotations

from typing import Protocol

from fastdecode.config import unknown_name_error
from fastdecode.decoding import (
    assisted,
    autoregressive,
    jacobi,
    lookahead,
    prompt_lookup,
    self_speculative,
    skipdecode,
)
from fastdecode.decoding.common import DecodeConfig, DecodeOutput, check, prefill
from fastdecode.decoding.options import JacobiOptions, LookupOptions, SkipOptions
from fastdecode.decoding.policies import POLICIES, DraftPolicy
from fastdecode.model import EarlyExitModel


class Decoder(Protocol):
    def __call__(
        self,
        m: EarlyExitModel,
        prompts: list[list[int]],
        cfg: DecodeConfig,
        draft: EarlyExitModel | None = None,
    ) -> DecodeOutput: ...


DECODERS: dict[str, Decoder] = {
    "autoregressive": autoregressive.generate,
    "assisted": assisted.generate,
    "self_speculative": self_speculative.generate,
    "prompt_lookup": prompt_lookup.generate,
    "lookahead": lookahead.generate,
    "skipdecode": skipdecode.generate,
    "jacobi": jacobi.generate,
}


def get_decoder(name: str) -> Decoder:
    """The strategy registered as ``name``; an unknown name raises a ConfigError listing the choices."""
    if name not in DECODERS:
        raise unknown_name_error("decoder", name, list(DECODERS), "(fastdecode.decoding.DECODERS)")
    return DECODERS[name]


__all__ = [
    "DECODERS",
    "POLICIES",
    "DecodeConfig",
    "DecodeOutput",
    "Decoder",
    "DraftPolicy",
    "JacobiOptions",
    "LookupOptions",
    "SkipOptions",
    "check",
    "get_decoder",
    "prefill",
]
