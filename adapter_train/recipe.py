"""``recipe=exit_adapter``: exit adapters on a frozen model (Kangaroo: "Kangaroo: Lossless Self-Speculative
Decoding via Double Early Exiting", Liu et al., 2024).

``ExitAdapterRecipe`` runs the ``recipes.finetune`` sequence with ``AdapterLM`` under ``AdapterTrainer``: a
feature cache of the frozen model is the Trainer's dataset, one adapter per exit is trained on it, and the
export is ``final/E<e>/`` per exit and ``final/adapters.json``, never the base weights. The steps are in
docs/design/methods.md. The method code (loss, module, trainer, report) lives in ``adapter_train/``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from adapter_train.config import ExitAdapterConfig
from adapter_train.module import AdapterLM
from adapter_train.report import report
from adapter_train.trainer import AdapterTrainer
from fastdecode.config import ConfigError, group_choices, load_group, to_dataclass, unknown_name_error
from fastdecode.data.chat import build_datasets
from fastdecode.data.config import DataConfig
from fastdecode.data.draft_vocab import draft_vocab_from_examples
from fastdecode.drafters.exits.adapter import (
    INDEX_FILE,
    DraftVocabMismatchError,
    ExitAdapter,
    build_adapter,
    load_adapter,
    save_adapter,
)
from fastdecode.files.distributed import is_main_process
from fastdecode.files.draft_vocab_file import load_draft_vocab
from fastdecode.files.io import atomic_write_json
from fastdecode.reports.exits import model_perplexity
from fastdecode.runtime.identity import weights_fingerprint
from fastdecode.runtime.machine import machine_label
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training.features import FeatureDataset, cache_training_features, collate_features
from recipes.common import TrainJob, job_tokenizer
from recipes.finetune import FinetuneRun, Recipe, finetune

log = logging.getLogger(__name__)


def given_draft_vocabulary(rcfg: ExitAdapterConfig, tokenizer, head_rows: int) -> torch.Tensor | None:
    """``recipe.draft_vocab`` (a file) checked against the tokenizer and the model's ``head_rows``: its ids
    ``[S]`` on the CPU, or None."""
    if rcfg.draft_vocab is None:
        return None
    ids, vocab_size = load_draft_vocab(rcfg.draft_vocab)
    if vocab_size != len(tokenizer) or len(ids) == 0 or int(ids.max()) >= head_rows:
        raise DraftVocabMismatchError(
            f"recipe.draft_vocab={rcfg.draft_vocab!r} was built for a vocabulary of {vocab_size} ids but "
            f"this tokenizer has {len(tokenizer)} (the model's head {head_rows} rows): rebuild it with "
            "this tokenizer, or set recipe.draft_vocab=null."
        )
    return ids


def draft_vocabulary(rcfg: ExitAdapterConfig, train: list[dict], tokenizer, m: EarlyExitModel, given):
    """The draft vocabulary the adapters train and draft with: the given one, the most frequent trained-on
    tokens (``draft_vocab_size``), or None (the full head)."""
    if given is not None:
        return given.to(m.device)
    if rcfg.draft_vocab_size is None or rcfg.draft_vocab_size >= len(tokenizer):
        return None
    return draft_vocab_from_examples(train, tokenizer, rcfg.draft_vocab_size).to(m.device)


def _report_set(rcfg: ExitAdapterConfig, tokenizer, held_out: list[dict]) -> list[dict]:
    if rcfg.report.data is None:
        return held_out
    if rcfg.report.data not in group_choices("data"):
        raise unknown_name_error(
            "recipe.report.data", rcfg.report.data, group_choices("data"), "(configs/data)"
        )
    data = load_group("data", rcfg.report.data, DataConfig, max_samples=1)
    return build_datasets(data, tokenizer)[1]


class ExitAdapterRecipe(Recipe):
    """Adapters beside a frozen model: the feature cache is the Trainer's dataset, ``AdapterLM`` (adapters
    only) its module; the export is ``final/E<e>/`` per exit and ``final/adapters.json``, never the base."""

    trainer_class = AdapterTrainer
    checkpoints_the_model = False  # adapters only: the feature cache is what is big (its own disk check)

    def __init__(self, job: TrainJob) -> None:
        super().__init__(job)
        self.rcfg = to_dataclass(ExitAdapterConfig, job.recipe, "recipe")
        self.given_vocab: torch.Tensor | None = None  # recipe.draft_vocab, checked before the weights load
        self.m: EarlyExitModel | None = None  # the frozen model (set by ``loaded``)
        self.base_hash = ""
        self.adapters: dict[int, ExitAdapter] = {}
        self.vocab: torch.Tensor | None = None  # the draft vocabulary [S] (None: the full head)
        self.report_set: list[dict] = []
        self.training: dict = {}  # what training did (set by ``export``)
        self.feature_dir = Path(self.rcfg.features.dir or Path(job.output_dir) / "features")
        self.reader = None  # the feature cache (set by ``datasets``)
        self.index: dict = {}  # final/adapters.json (set by ``after_report``)

    def prepare(self) -> None:
        if self.job.peft.method != "none":
            raise ConfigError(
                "recipe=exit_adapter trains adapters beside a frozen model: set peft=none (LoRA would "
                "change the base model the adapters draft for)."
            )

    def validate(self, config) -> None:  # ExitLayerError and DraftVocabMismatchError before the weights load
        self.rcfg.validate(config.num_hidden_layers)
        self.given_vocab = given_draft_vocabulary(self.rcfg, job_tokenizer(self.job), config.vocab_size)

    def loaded(self, model, tokenizer) -> None:
        model.requires_grad_(False)
        model.eval()
        self.base_hash = weights_fingerprint(model, full=True)  # checked bitwise before the export
        self.m = m = EarlyExitModel(model)
        rcfg = self.rcfg
        self.adapters = {e: build_adapter(m, e, rcfg.kind, rcfg.init, rcfg.zero_init) for e in rcfg.exits}

    def datasets(self, tokenizer) -> tuple[FeatureDataset, list[dict]]:
        """The draft vocabulary, the report's set, then the feature cache (built or resumed): the frozen
        model's work, all before training."""
        rcfg, m = self.rcfg, self.m
        train, held_out = build_datasets(self.job.data, tokenizer)
        self.vocab = draft_vocabulary(rcfg, train, tokenizer, m, self.given_vocab)
        self.report_set = _report_set(rcfg, tokenizer, held_out) if rcfg.report.enabled else []
        self.reader = cache_training_features(
            m,
            tokenizer,
            train,
            self.feature_dir,
            rcfg.features,
            exits=rcfg.cached_exits(),
            data=self.job.data,
        )
        return FeatureDataset(self.reader, rcfg.exits, rcfg.loss.target), held_out

    def eval_dataset(self, held_out: list[dict]) -> None:
        return None  # held-out conversations feed the report (agreement on the model's own generations)

    def collator(self, tokenizer, model):
        return functools.partial(collate_features, exits=self.rcfg.exits)

    def training_args(self) -> dict:
        return {"remove_unused_columns": False}  # cached records are not AdapterLM's forward arguments

    def module(self, model, args) -> AdapterLM:
        """``self.adapters`` around ``model``'s frozen layers; after the export, the adapters loaded back."""
        m = self.m if model is self.m.hf else EarlyExitModel(model)  # one adapter of the model: its engines
        return AdapterLM(m, self.adapters, self.rcfg.loss, self.vocab)

    def summary(self) -> dict:
        features = {"dir": str(self.feature_dir), **self.reader.manifest.get("summary", {})}
        final = Path(self.job.output_dir) / "final"
        return {"final": str(final), "features": features, "base_weights_sha256": self.base_hash}

    def before_report(self, model, tokenizer, held_out: list[dict]) -> dict | None:
        """The base model's perplexity, to compare with the one after training (equal by construction)."""
        with torch.no_grad():
            r = self.rcfg.report
            return model_perplexity(self.m, self.report_set, r.held_out_examples) if self.report_set else None

    def export(self, run: FinetuneRun):
        """The adapters into ``final/E<e>/`` (the base weights, checked bitwise, are never written); then
        loaded back, so the export check and the reports run the saved adapters. Returns the base model."""
        if weights_fingerprint(self.m.hf, full=True) != self.base_hash:
            raise RuntimeError(
                "the base model's weights changed during adapter training: they must stay frozen"
            )
        self.training = training_stats(run, self.reader)
        if not is_main_process():
            return None
        meta = self._meta(run)
        for e, adapter in self.adapters.items():
            save_adapter(adapter.eval(), run.stage / f"E{e}", self.m, run.tokenizer, self.vocab, meta=meta)
        self.adapters = {
            e: load_adapter(run.stage / f"E{e}", self.m, run.tokenizer)[0] for e in self.adapters
        }
        return self.m.hf

    def _meta(self, run: FinetuneRun) -> dict:
        """The training record of every saved adapter's ``adapter.json``."""
        rcfg, t = self.rcfg, self.training
        return {
            "recipe": "exit_adapter",
            "loss": dataclasses.asdict(rcfg.loss),
            "data": self.job.data.name,
            "features": str(self.feature_dir),
            "scored_positions": t["scored_positions"],
            "epochs": t["epochs"],
            "learning_rate": run.args.learning_rate,
            "seconds": t["seconds"],
            "init": rcfg.init,
            "zero_init": rcfg.zero_init,
        }

    def after_report(self, run: FinetuneRun) -> dict:
        final = run.out / "final"
        summary = {
            "adapters": {str(e): str(final / f"E{e}") for e in self.adapters},
            "training": self.training,
            "base_weights_unchanged": True,
        }
        self.index, fields = report(
            self.m,
            run.tokenizer,
            self.report_set,
            self.rcfg,
            adapters=self.adapters,
            vocab=self.vocab,
            feature_dir=self.feature_dir,
            stage=run.stage,
        )
        return summary | fields | {"perplexity_before": run.before}

    def extra_files(self, run: FinetuneRun) -> dict:
        atomic_write_json(run.stage / INDEX_FILE, self.index)
        return {}


def training_stats(run: FinetuneRun, reader) -> dict:
    """What training did: the Trainer's metrics, time, scored positions (per second) and the loss history."""
    metrics = run.summary["metrics"]
    seconds = float(metrics.get("train_runtime", 0.0))  # 0: a resumed run that had already finished
    scored = sum(len(reader.read(i, ["scored"])["scored"]) for i in range(len(reader)))
    epochs = float(metrics.get("epoch", run.trainer.state.epoch or 0.0))
    return {
        "metrics": dict(metrics),
        "seconds": seconds,
        "scored_positions": scored,
        "epochs": epochs,
        "scored_positions_per_s": scored * epochs / seconds if seconds > 0 else None,
        "measured_on": machine_label(run.args.device),
        "history": [h for h in run.trainer.state.log_history if "loss" in h],
    }


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Cache features, train the adapters, save, report. Returns the summary (also ``summary.json``)."""
    return finetune(job, cfg, ExitAdapterRecipe(job)).summary
