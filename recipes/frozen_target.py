"""The recipes that train a drafter beside a frozen target on its cached features (``recipe=eagle3``,
``recipe=dflash``): what they share, written once.

``FrozenTargetRecipe`` freezes and fingerprints the target, builds or resumes the feature cache (and, with
``features.source=generate``, keeps the target's answers for ``corpus.sfx``), picks the report's held-out
prompts, gathers the trained drafter for the export and writes ``acceptance.json`` and ``corpus.sfx``. A
subclass builds its drafter, its module and its export.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastdecode.api import DRAFTER_CORPUS
from fastdecode.config import ConfigError, group_choices, load_group, unknown_name_error
from fastdecode.data.chat import build_datasets
from fastdecode.data.config import DataConfig
from fastdecode.data.twins import drop_twins, prompt_keys
from fastdecode.files.distributed import is_main_process
from fastdecode.plan.acceptance import write_record
from fastdecode.registry import corpus_fingerprint
from fastdecode.runtime.identity import weights_fingerprint
from fastdecode.runtime.machine import machine_label
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training.answers import generated_answers, save_corpus
from fastdecode.training.features import cache_training_features, generation_prompts
from recipes.common import TrainJob, full_state_dict
from recipes.finetune import FinetuneRun, Recipe

log = logging.getLogger(__name__)


class FrozenTargetRecipe(Recipe):
    """A drafter beside a frozen target: the cached features are the Trainer's dataset, the export is the
    drafter, never the target. ``self.rcfg`` (set by the subclass) has ``features`` and ``report``."""

    checkpoints_the_model = False  # the drafter only
    drafter_name = "drafter"  # in messages: "EAGLE-3 head", "DFlash drafter"
    state_prefix = "draft."  # the drafter's parameters inside the training module

    def __init__(self, job: TrainJob) -> None:
        super().__init__(job)
        self.rcfg: Any = None
        self.m: EarlyExitModel | None = None
        self.base_hash = ""
        self.reader = None
        self.report_prompts: list[list[int]] = []
        self.figures: dict = {}
        self.answers: list[dict] = []  # the target's generated training answers (source=generate)
        self.fingerprint: dict = {}

    @property
    def feature_dir(self) -> Path:
        return Path(self.rcfg.features.dir or Path(self.job.output_dir) / "features")

    def prepare(self) -> None:
        if self.job.peft.method != "none":
            raise ConfigError(
                f"recipe={self.job.recipe.get('name')} trains a {self.drafter_name} beside a frozen target: set "
                f"peft=none (LoRA would change the target it drafts for)."
            )
        data = self.rcfg.report.data
        if self.rcfg.report.enabled and data is not None and data not in group_choices("data"):
            raise unknown_name_error("recipe.report.data", data, group_choices("data"), "(configs/data)")

    def loaded(self, model, tokenizer) -> None:
        model.requires_grad_(False)
        model.eval()
        self.base_hash = weights_fingerprint(model, full=True)
        self.m = EarlyExitModel(model)

    def cached_features(self, train: list[dict], tokenizer, exits: list[int]):
        """The feature cache over the training split (built or resumed); with ``source=generate`` the
        target's answers are kept for ``corpus.sfx`` (read from the cache: no new generation)."""
        features = self.rcfg.features
        self.reader = cache_training_features(
            self.m, tokenizer, train, self.feature_dir, features, exits=exits, data=self.job.data
        )
        if features.source == "generate":
            prompts = generation_prompts(train, tokenizer, features.max_prompt_tokens)
            self.answers = generated_answers(self.reader, prompts, tokenizer)
            self.fingerprint = corpus_fingerprint(tokenizer)
        return self.reader

    def report_prompts_for(self, tokenizer, held_out: list[dict], train: list[dict]) -> None:
        """The report's held-out prompts; another data config's drop those with a twin among the training
        prompts (``data.twins``; the training data's own held-out split has none)."""
        r = self.rcfg.report
        if not r.enabled:
            return
        if r.data is not None:
            held_out = build_datasets(load_group("data", r.data, DataConfig, max_samples=1), tokenizer)[1]
            trained = prompt_keys(ex.get("prompt") for ex in train)
            held_out = drop_twins(held_out, trained, lambda ex: ex.get("prompt"))[0]
        found = generation_prompts(held_out, tokenizer, r.max_prompt_tokens)
        self.report_prompts = [p["input_ids"] for p in found[: r.prompts]]

    def eval_dataset(self, held_out: list[dict]) -> None:
        return None  # held-out prompts feed the acceptance report

    def training_args(self) -> dict:
        return {"remove_unused_columns": False}

    def summary(self) -> dict:
        features = {"mode": self.rcfg.features.mode}
        if self.reader is not None:
            features |= {"dir": str(self.feature_dir), **self.reader.manifest.get("summary", {})}
        final = Path(self.job.output_dir) / "final"
        return {"final": str(final), "features": features, "base_weights_sha256": self.base_hash}

    def trained_state(self, run: FinetuneRun) -> dict | None:
        """The trained drafter's parameters, gathered on every rank (ZeRO-3 partitions), without the module's
        prefix; None off rank 0. Refuses a target whose weights changed."""
        if weights_fingerprint(self.m.hf, full=True) != self.base_hash:
            raise RuntimeError(
                f"the target's weights changed while training the {self.drafter_name}: they must stay frozen"
            )
        trained = full_state_dict(run.trainer.accelerator.unwrap_model(run.trainer.model_wrapped))
        if not is_main_process():
            return None
        p = self.state_prefix
        return {k.removeprefix(p): v for k, v in trained.items() if k.startswith(p)}

    def extra_files(self, run: FinetuneRun) -> dict:
        """``acceptance.json``, and ``corpus.sfx``: the answers the target generated for the drafter's training
        (the training split only), token ids as generated, its prompts' twin keys in the header."""
        if self.figures:
            write_record(run.stage, self.drafter_record(self.figures, machine_label(run.args.device)))
        if not self.answers:
            return {}
        sequences = [a["response_ids"] for a in self.answers]
        prompts = [a["prompt"] for a in self.answers]
        path = run.stage / DRAFTER_CORPUS
        built = save_corpus(path, sequences, prompts, fingerprint=self.fingerprint)
        return {"corpus": built | {"path": str(run.out / "final" / DRAFTER_CORPUS)}}

    def drafter_record(self, figures: dict, machine: str) -> dict:
        """The ``acceptance.json`` record of the measured figures (the subclass's report)."""
        raise NotImplementedError
