"""``decoder.eagle3``: the EAGLE-3 head's drafting options (chains, or EAGLE-2's dynamic trees)."""

from __future__ import annotations

from dataclasses import dataclass

from fastdecode.config import ConfigError
from fastdecode.decoding.config import DrafterOptions


@dataclass
class Eagle3Options(DrafterOptions, group="eagle3"):
    """``decoder.eagle3``: the ``eagle3`` decoder's options. ``tree``: draft EAGLE-2's dynamic token trees
    (the speculative loop verifies them: ``Draft.parents``) instead of a chain; ``top_k``: the children each
    expanded node offers, and the nodes each level expands. False (the default): a chain, drafted exactly as
    without this group."""

    tree: bool = False
    top_k: int = 4

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ConfigError(
                f"decoder.eagle3.top_k={self.top_k}: need >= 1 (the children each expanded tree node offers)."
            )
