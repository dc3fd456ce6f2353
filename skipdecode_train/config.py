"""``configs/recipe/skipdecode.yaml`` as a typed dataclass; ``training_policy`` turns it into the model's policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fastdecode.config import ConfigError
from fastdecode.skipdecode import SkipDecodePolicy, SkipOptions


@dataclass
class SkipDecodeConfig(SkipOptions):
    """The recipe's config: SkipDecode's four options (``SkipOptions``: ``max_budget``, ``min_budget``,
    ``warmup_layers``, ``max_length``, with the meanings they have under ``decoder.skip``) and the recipe's own
    keys. Training, ``max_length`` left None is ``data.max_length``."""

    KEYS: ClassVar[str] = "recipe."

    name: str = "skipdecode"
    evaluate_before: bool = True  # held-out loss under the policy before training too (before/after)

    def training_policy(self, num_layers: int, data_max_length: int) -> SkipDecodePolicy:
        """The validated policy for a model of ``num_layers`` trained on rows of ``data_max_length`` tokens.

        Why ``max_length >= data.max_length``: a response can start anywhere in a row, and the budget decays
        between the (latest) response start and max_length, so a shorter max_length fails mid-training.
        """
        if self.max_length is not None and self.max_length < data_max_length:
            raise ConfigError(
                f"recipe.max_length={self.max_length} is shorter than data.max_length={data_max_length}: a "
                "response may start after it; set recipe.max_length >= data.max_length (or null to use it)."
            )
        return self.policy(num_layers, data_max_length)
