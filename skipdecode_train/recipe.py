"""``recipe=skipdecode``: fine-tune under the SkipDecode policy (Del Corro et al., 2023) on the HF Trainer.

The ``recipes.finetune`` sequence with ``SkipDecodeLM`` (final-layer CE, the policy run exactly in
the forward) under the plain Trainer: policy check -> data -> held-out perplexity under the policy (before)
-> train -> export (verified against the live model under the policy) -> held-out perplexity (after) ->
``final/skipdecode.json``: the policy it trained with (``fastdecode.skipdecode.save_trained_policy``), every
option set; decoding the checkpoint uses it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from fastdecode.config import ConfigError, to_dataclass
from fastdecode.data.chat import collate
from fastdecode.reports.skipdecode import policy_perplexity
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.skipdecode import SkipDecodePolicy, save_trained_policy
from recipes.common import TrainJob
from recipes.finetune import FinetuneRun, Recipe, finetune
from skipdecode_train.config import SkipDecodeConfig
from skipdecode_train.module import SkipDecodeLM

log = logging.getLogger(__name__)


class SkipDecode(Recipe):
    """``SkipDecodeLM`` (the policy in the forward) under the plain Trainer; held-out perplexity under the
    policy before and after; the trained policy next to the checkpoint."""

    def __init__(self, job: TrainJob) -> None:
        super().__init__(job)
        self.rcfg = to_dataclass(SkipDecodeConfig, job.recipe, "recipe")
        self.policy: SkipDecodePolicy | None = None

    def prepare(self) -> None:
        if self.job.data.packing:
            raise ConfigError(
                "recipe=skipdecode trains one conversation per row (the budget counts from each response "
                "start); set data.packing=false."
            )

    def validate(self, config) -> None:  # the policy is built (and checked) before the weights load
        self.policy = self.rcfg.training_policy(config.num_hidden_layers, self.job.data.max_length)

    def collator(self, tokenizer, model):
        return functools.partial(collate, pad_id=tokenizer.pad_token_id, mask_dtype=model.dtype, four_d=False)

    def module(self, model, args) -> SkipDecodeLM:
        return SkipDecodeLM(model, self.policy)

    def summary(self) -> dict:
        return {"policy": {"skip": dataclasses.asdict(self.policy.options())}}

    def before_report(self, model, tokenizer, held_out: list[dict]) -> dict | None:
        if not (self.rcfg.evaluate_before and held_out):
            return None
        return policy_perplexity(EarlyExitModel(model), lambda _: self.policy, held_out)

    def after_report(self, run: FinetuneRun) -> dict:
        m = EarlyExitModel(run.final)
        after = policy_perplexity(m, lambda _: self.policy, run.held_out) if run.held_out else None
        log.info("skipdecode done: before %s, after %s", run.before, after)
        return {"held_out": {"before": run.before, "after": after}}

    def extra_files(self, run: FinetuneRun) -> dict:
        save_trained_policy(run.stage, self.policy)
        return {}


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Train under the policy, export, measure. Returns the checkpoint path, metrics and the policy."""
    return finetune(job, cfg, SkipDecode(job)).summary
