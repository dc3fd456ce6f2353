"""``recipe=dflash``: a DFlash block drafter for a frozen target (Chen et al., 2026, "DFlash: Block Diffusion
for Flash Speculative Decoding").

``DFlashRecipe`` runs the ``recipes.finetune`` sequence with ``DFlashLM`` under ``DFlashTrainer``: the target's
cached features are the training data (the cache ``recipe=eagle3`` builds serves both), random anchors over
the response tokens give the blocks, all trained in one forward per batch; the export is ``final/`` in the
native format (``DFlashDraftModel``), never the target. Acceptance goes to ``final/acceptance.json``; the
target's generated training answers to ``final/corpus.sfx``. The steps are in docs/design/methods.md.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

from dflash_train.config import DFlashRecipeConfig
from dflash_train.module import DFlashLM, check_target_head, collate_records
from dflash_train.report import drafter_record, measure, table_text
from dflash_train.trainer import DFlashTrainer
from fastdecode.api import DRAFTER_CORPUS
from fastdecode.config import ConfigError, group_choices, load_group, to_dataclass, unknown_name_error
from fastdecode.data.chat import build_datasets
from fastdecode.data.config import DataConfig
from fastdecode.data.twins import drop_twins, prompt_keys
from fastdecode.drafters.dflash.files import load_dflash, save_dflash
from fastdecode.drafters.dflash.layer import DFlashDraft
from fastdecode.drafters.dflash.model import DFlashConfig, choose_mask_token
from fastdecode.files.distributed import is_main_process
from fastdecode.plan.acceptance import write_record
from fastdecode.registry import corpus_fingerprint
from fastdecode.runtime.identity import weights_fingerprint
from fastdecode.runtime.machine import machine_label
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.tokens import eos_ids
from fastdecode.training.answers import generated_answers, save_corpus
from fastdecode.training.features import FeatureDataset, cache_training_features, generation_prompts
from recipes.common import TrainJob, full_state_dict, job_tokenizer
from recipes.finetune import FinetuneRun, Recipe, finetune

log = logging.getLogger(__name__)


class RecordDataset(FeatureDataset):
    """The cached records with what the drafter needs: the feature layers, the tokens, the scored positions
    and, for a KL loss, the target's head input there (``final``)."""

    def __init__(self, reader, exits: list[int], *, teacher: bool) -> None:
        super().__init__(reader, exits, "full")
        if not teacher:
            self.fields.remove("final")
        self.fields.append("input_ids")


class DFlashRecipe(Recipe):
    """The drafter beside a frozen target: the cached features are the Trainer's dataset, the export is the
    drafter in the native format, never the target."""

    trainer_class = DFlashTrainer
    checkpoints_the_model = False  # the drafter only

    def __init__(self, job: TrainJob) -> None:
        super().__init__(job)
        self.rcfg = to_dataclass(DFlashRecipeConfig, job.recipe, "recipe")
        self.m: EarlyExitModel | None = None
        self.draft: DFlashDraft | None = None
        self.cfg: DFlashConfig | None = None
        self.mask_reason = ""
        self.base_hash = ""
        self.feature_dir = Path(self.rcfg.features.dir or Path(job.output_dir) / "features")
        self.reader = None
        self.report_prompts: list[list[int]] = []
        self.figures: dict = {}
        self.answers: list[dict] = []  # the target's generated training answers (source=generate)
        self.fingerprint: dict = {}

    def prepare(self) -> None:
        if self.job.peft.method != "none":
            raise ConfigError(
                "recipe=dflash trains a drafter beside a frozen target: set peft=none (LoRA would change the "
                "target the drafter drafts for)."
            )
        if self.rcfg.report.enabled and self.rcfg.report.data is not None:
            if self.rcfg.report.data not in group_choices("data"):
                raise unknown_name_error(
                    "recipe.report.data", self.rcfg.report.data, group_choices("data"), "(configs/data)"
                )

    def validate(self, config) -> None:
        """Every setting against the target's config and tokenizer, before its weights load: the layers, the
        feature cache's exits, the mask token (``choose_mask_token``), the drafter's shape."""
        r = self.rcfg
        r.validate(config)
        mask, self.mask_reason = choose_mask_token(
            job_tokenizer(self.job), config.vocab_size, r.mask_token_id
        )
        self.cfg = DFlashConfig.from_target(
            config,
            mask_token_id=mask,
            num_hidden_layers=r.num_hidden_layers,
            target_layer_ids=r.layer_ids(config.num_hidden_layers),
            block_size=r.block_size,
        )

    def loaded(self, model, tokenizer) -> None:
        model.requires_grad_(False)
        model.eval()
        self.base_hash = weights_fingerprint(model, full=True)
        self.m = EarlyExitModel(model)
        check_target_head(self.m, self.cfg.hidden_size)

    def datasets(self, tokenizer) -> tuple[Any, list[dict]]:
        """The feature cache (built or resumed), the drafter, and the report's held-out prompts."""
        rcfg, m = self.rcfg, self.m
        train, held_out = build_datasets(self.job.data, tokenizer)
        if rcfg.report.enabled:
            self.report_prompts = self._report_prompts(tokenizer, held_out, train)
        exits = rcfg.cached_exits(m.num_layers)
        self.reader = cache_training_features(
            m, tokenizer, train, self.feature_dir, rcfg.features, exits=exits, data=self.job.data
        )
        if rcfg.features.source == "generate":  # the corpus beside the drafter: these answers, no new ones
            prompts = generation_prompts(train, tokenizer, rcfg.features.max_prompt_tokens)
            self.answers = generated_answers(self.reader, prompts, tokenizer)
            self.fingerprint = corpus_fingerprint(tokenizer)
        dataset = RecordDataset(self.reader, self.cfg.feature_ids, teacher=rcfg.loss != "ce")
        self.draft = DFlashDraft(self.cfg).to(m.device)
        return dataset, held_out

    def _report_prompts(self, tokenizer, held_out: list[dict], train: list[dict]) -> list[list[int]]:
        """The report's held-out prompts; another data config's drop those with a twin among the training
        prompts (``data.twins``; the training data's own held-out split has none)."""
        r = self.rcfg.report
        if r.data is not None:
            held_out = build_datasets(load_group("data", r.data, DataConfig, max_samples=1), tokenizer)[1]
            trained = prompt_keys(ex.get("prompt") for ex in train)
            held_out = drop_twins(held_out, trained, lambda ex: ex.get("prompt"))[0]
        found = generation_prompts(held_out, tokenizer, r.max_prompt_tokens)
        return [p["input_ids"] for p in found[: r.prompts]]

    def eval_dataset(self, held_out: list[dict]) -> None:
        return None  # held-out prompts feed the acceptance report

    def collator(self, tokenizer, model):
        return functools.partial(collate_records, feature_ids=self.cfg.feature_ids)

    def training_args(self) -> dict:
        return {"remove_unused_columns": False}

    def module(self, model, args) -> DFlashLM:
        r = self.rcfg
        loss = {"kind": r.loss, "gamma": r.gamma, "num_anchors": r.num_anchors, "seed": self.job.seed}
        m = self.m if model is self.m.hf else EarlyExitModel(model)
        return DFlashLM(m, self.draft, loss)

    def summary(self) -> dict:
        features = {"mode": self.rcfg.features.mode}
        if self.reader is not None:
            features |= {"dir": str(self.feature_dir), **self.reader.manifest.get("summary", {})}
        final = Path(self.job.output_dir) / "final"
        return {"final": str(final), "features": features, "base_weights_sha256": self.base_hash}

    def export(self, run: FinetuneRun):
        """The trained drafter (gathered on every rank: ZeRO-3 partitions) into ``final/`` on rank 0, loaded
        back (the export check and the report then run the saved drafter, which must equal the trained one).
        Returns the target on rank 0, None elsewhere."""
        if weights_fingerprint(self.m.hf, full=True) != self.base_hash:
            raise RuntimeError("the target's weights changed during DFlash training: they must stay frozen")
        trained = full_state_dict(
            run.trainer.accelerator.unwrap_model(run.trainer.model_wrapped)
        )  # all ranks
        if not is_main_process():
            return None
        draft = DFlashDraft(self.cfg)  # on the CPU, whole (ZeRO-3 partitions gathered above)
        draft.load_state_dict(
            {k.removeprefix("draft."): v for k, v in trained.items() if k.startswith("draft.")}
        )
        draft.eval()
        save_dflash(draft, run.stage, in_place=True)
        loaded, cfg = load_dflash(run.stage)
        live = draft.state_dict()
        if cfg != self.cfg or any(not torch.equal(v, live[k]) for k, v in loaded.state_dict().items()):
            raise RuntimeError(
                f"the drafter saved in {run.stage} does not load back equal to the trained one"
            )
        self.draft = loaded.float().to(self.m.device)
        return self.m.hf

    def after_report(self, run: FinetuneRun) -> dict:
        cfg = self.cfg
        out = {
            "drafter": str(run.out / "final"),
            "target_layer_ids": cfg.target_layer_ids,
            "feature_ids": cfg.feature_ids,
            "block_size": cfg.block_size,
            "speculative_tokens": self.rcfg.drafts,
            "mask_token_id": cfg.mask_token_id,
            "mask_token": self.mask_reason,
            "base_weights_unchanged": True,
        }
        if not self.report_prompts:
            return out
        r = self.rcfg.report
        self.figures = measure(
            self.draft,
            self.m,
            self.report_prompts,
            max_new_tokens=r.max_new_tokens,
            batch_size=r.batch_size,
            eos=eos_ids(self.m.hf, run.tokenizer),
        )
        log.info("%s", table_text(self.figures))
        return out | {"acceptance": self.figures}

    def extra_files(self, run: FinetuneRun) -> dict:
        """``acceptance.json``, and ``corpus.sfx``: the answers the target generated for the drafter's training
        (the training split only), token ids as generated, its prompts' twin keys in the header."""
        if self.figures:
            write_record(run.stage, drafter_record(self.figures, machine_label(run.args.device)))
        if not self.answers:
            return {}
        sequences = [a["response_ids"] for a in self.answers]
        prompts = [a["prompt"] for a in self.answers]
        path = run.stage / DRAFTER_CORPUS
        built = save_corpus(path, sequences, prompts, fingerprint=self.fingerprint)
        return {"corpus": built | {"path": str(run.out / "final" / DRAFTER_CORPUS)}}


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Cache the target's features (or reuse them), train the drafter, save it, measure it. Returns the
    summary (also ``summary.json``)."""
    return finetune(job, cfg, DFlashRecipe(job)).summary
