"""Per-decoder option groups, nested in ``DecodeConfig``: ``decoder.jacobi.*`` and ``decoder.skip.*``.

Why nested: the fields every decoder reads (length, sampling, exit layer, draft policy) stay flat in
``DecodeConfig``; options that only one decoder reads sit in a group named after it, so ``common.py`` knows
nothing of any one decoder and a Hydra override says which decoder it tunes (``jacobi.block=8``).
Each group checks what it can without a model; the rest is checked by its decoder against the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdecode.config import ConfigError
from fastdecode.jacobi import check_block_size, check_init


@dataclass
class JacobiOptions:
    """``decoder.jacobi``: the ``jacobi`` decoder (``fastdecode/decoding/jacobi.py``). ``block``: the n >= 2
    tokens refined in parallel; ``init``: the initial guess, ``repeat`` | ``prompt`` | ``vocab``."""

    block: int = 16
    init: str = "repeat"

    def __post_init__(self) -> None:
        check_block_size(self.block, "decoder.jacobi.block")
        check_init(self.init, "decoder.jacobi.init")


@dataclass
class SkipOptions:
    """``decoder.skip``: the SkipDecode policy of the ``skipdecode`` decoder (``fastdecode/skipdecode.py``).

    ``max_budget``: layers at the first new token (None: all); ``min_budget``: at ``max_length`` and after
    (None: = max); ``warmup_layers``: bottom layers every token runs; ``max_length``: the position T where the
    decay ends (None: longest prompt + ``max_new_tokens``). Bounds that need the model are checked by
    ``fastdecode.decoding.skipdecode.policy_from_config``.
    """

    max_budget: int | None = None
    min_budget: int | None = None
    warmup_layers: int = 1
    max_length: int | None = None

    def __post_init__(self) -> None:
        low, high = self.min_budget, self.max_budget
        if low is not None and high is not None and low > high:
            raise ConfigError(f"decoder.skip.min_budget={low} > decoder.skip.max_budget={high}: must be <=.")
