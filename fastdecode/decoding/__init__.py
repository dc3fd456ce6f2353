"""Decoding strategies: free functions over the model (``EarlyExitModel``) and its explicit KV cache, one strategy per module.

Every strategy has the same signature, so callers (eval, benchmarks) pick one by name::

    out = get_decoder("self_speculative")(m, prompts, DecodeConfig(max_new_tokens=64, exit_layer=8))

``PROPOSERS`` holds the kinds of draft the speculative loop verifies (``drafters.ProposerKind``: a new drafter
is one line there), ``DECODERS`` every strategy by name, the kinds' included; ``get_decoder`` finds both.

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
    eagle3,
    jacobi,
    lookahead,
    prompt_lookup,
    self_speculative,
    skipdecode,
    suffix,
)
from fastdecode.decoding.common import DecodeConfig, DecodeOutput, check, prefill
from fastdecode.decoding.drafters import FIRST_STAGES, Offer, PlanInputs, ProposerKind
from fastdecode.decoding.options import (
    Eagle3Options,
    JacobiOptions,
    LookupOptions,
    SkipOptions,
    SuffixOptions,
)
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


# The kinds of draft the one speculative loop verifies (fastdecode/decoding/drafters.py): each is a decoder of
# its name, and ``auto`` (fastdecode/choose.py) plans with the ones that make offers.
PROPOSERS: dict[str, ProposerKind] = {
    "self_speculative": self_speculative.KIND,
    "assisted": assisted.KIND,
    "prompt_lookup": prompt_lookup.KIND,
    "lookahead": lookahead.KIND,
    "eagle3": eagle3.KIND,
    "suffix": suffix.KIND,
}

# A chain's first stages besides prompt lookup (decoder.suffix.first: suffix decoding drafts first).
FIRST_STAGES["suffix"] = suffix.build

# Every decoding strategy by name: the ones that are not speculation, one per module, then each proposer kind.
DECODERS: dict[str, Decoder] = {
    "autoregressive": autoregressive.generate,
    "skipdecode": skipdecode.generate,
    "jacobi": jacobi.generate,
    **{name: kind.generate for name, kind in PROPOSERS.items()},
}


def decoder_names() -> list[str]:
    """Every decoder a method may name: the strategies and the proposer kinds."""
    return list(dict.fromkeys([*DECODERS, *PROPOSERS]))


def get_decoder(name: str) -> Decoder:
    """The strategy or proposer kind registered as ``name``; an unknown name (or not a string) raises a
    ConfigError listing the choices."""
    if isinstance(name, str) and name in DECODERS:
        return DECODERS[name]
    if isinstance(name, str) and name in PROPOSERS:  # a kind registered after import
        return PROPOSERS[name].generate
    raise unknown_name_error("decoder", str(name), decoder_names(), "(fastdecode.decoding)")


__all__ = [
    "DECODERS",
    "PROPOSERS",
    "Offer",
    "PlanInputs",
    "ProposerKind",
    "decoder_names",
    "POLICIES",
    "DecodeConfig",
    "DecodeOutput",
    "Decoder",
    "DraftPolicy",
    "Eagle3Options",
    "JacobiOptions",
    "LookupOptions",
    "SkipOptions",
    "SuffixOptions",
    "check",
    "get_decoder",
    "prefill",
]
