"""``configs/recipe/skipdecode.yaml`` as a typed dataclass; ``policy`` turns it into the model's policy."""

from __future__ import annotations

from dataclasses import dataclass

from fastdecode.config import ConfigError
from fastdecode.skipdecode import SkipDecodePolicy


@dataclass
class SkipDecodeConfig:
    """The SkipDecode policy trained with (``fastdecode/skipdecode.py``), in layers and tokens."""

    name: str = "skipdecode"
    max_budget: int | None = None  # layers at the first response token; null: all layers
    min_budget: int | None = None  # layers at max_length and beyond; null: half the layers
    warmup_layers: int = 1  # bottom layers every token runs
    max_length: int | None = None  # T, where the budget reaches min_budget; null: data.max_length
    evaluate_before: bool = True  # held-out loss under the policy before training too (before/after)

    def policy(self, num_layers: int, data_max_length: int) -> SkipDecodePolicy:
        """The validated policy for a model of ``num_layers`` trained on rows of ``data_max_length`` tokens.

        Why ``max_length >= data.max_length``: a response can start anywhere in a row, and the budget decays
        between the (latest) response start and max_length, so a shorter max_length fails mid-training.
        """
        if self.max_length is not None and self.max_length < data_max_length:
            raise ConfigError(
                f"recipe.max_length={self.max_length} is shorter than data.max_length={data_max_length}: a "
                "response may start after it; set recipe.max_length >= data.max_length (or null to use it)."
            )
        max_budget = num_layers if self.max_budget is None else self.max_budget
        if self.min_budget is None:
            min_budget = min(max_budget, max(self.warmup_layers + 1, num_layers // 2))
        else:
            min_budget = self.min_budget
        return SkipDecodePolicy(
            num_layers=num_layers,
            max_budget=max_budget,
            min_budget=min_budget,
            warmup_layers=self.warmup_layers,
            max_length=data_max_length if self.max_length is None else self.max_length,
            keys="recipe.",
        )
