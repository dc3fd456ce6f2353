"""``decoder.dflash``: the DFlash drafter's one decoding option, the block width each drafter pass runs."""

from __future__ import annotations

from dataclasses import dataclass

from fastdecode.config import ConfigError
from fastdecode.decoding.config import DrafterOptions


@dataclass
class DFlashOptions(DrafterOptions, group="dflash"):
    """``decoder.dflash``: the ``dflash`` decoder's options. ``slots``: the block each drafter pass runs,
    ``[anchor, MASK x (slots - 1)]``, so a round drafts at most ``slots - 1`` tokens; None (the default): the
    drafter's own ``block_size``, the block it was trained on (the reference loop's). Fewer slots make the
    pass cheaper at some acceptance (vLLM runs ``1 + num_speculative_tokens`` of them)."""

    slots: int | None = None

    def __post_init__(self) -> None:
        if self.slots is not None and self.slots < 2:
            raise ConfigError(
                f"decoder.dflash.slots={self.slots}: a block needs its anchor and at least one mask (>= 2), "
                "or null for the drafter's block_size."
            )
