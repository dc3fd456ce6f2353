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
from typing import Any

import torch

from dflash_train.config import DFlashRecipeConfig
from dflash_train.module import DFlashLM, check_target_head, collate_records
from dflash_train.report import measure
from dflash_train.scaling import feature_rms, fold_feature_scale
from dflash_train.trainer import DFlashTrainer
from fastdecode.config import to_dataclass
from fastdecode.data.chat import build_datasets
from fastdecode.drafters.dflash.files import load_dflash, save_dflash
from fastdecode.drafters.dflash.layer import DFlashDraft
from fastdecode.drafters.dflash.model import DFlashConfig, choose_mask_token
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.tokens import eos_ids
from fastdecode.training.drafter_report import drafter_record, table_text
from fastdecode.training.features import FeatureDataset
from recipes.common import TrainJob, job_tokenizer
from recipes.finetune import FinetuneRun, finetune
from recipes.frozen_target import FrozenTargetRecipe

log = logging.getLogger(__name__)


class RecordDataset(FeatureDataset):
    """The cached records with what the drafter needs: the feature layers, the tokens, the scored positions
    and, for a KL loss, the target's head input there (``final``)."""

    def __init__(self, reader, exits: list[int], *, teacher: bool) -> None:
        super().__init__(reader, exits, "full")
        if not teacher:
            self.fields.remove("final")
        self.fields.append("input_ids")


class DFlashRecipe(FrozenTargetRecipe):
    """The drafter beside a frozen target (``recipes.frozen_target``): the export is the drafter in the native
    format."""

    trainer_class = DFlashTrainer
    drafter_name = "DFlash drafter"

    def __init__(self, job: TrainJob) -> None:
        super().__init__(job)
        self.rcfg = to_dataclass(DFlashRecipeConfig, job.recipe, "recipe")
        self.draft: DFlashDraft | None = None
        self.cfg: DFlashConfig | None = None
        self.mask_reason = ""
        self.scale: torch.Tensor | None = None  # the features' channel RMS while training (scaling.py)

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
        super().loaded(model, tokenizer)
        check_target_head(self.m, self.cfg.hidden_size)

    def datasets(self, tokenizer) -> tuple[Any, list[dict]]:
        """The feature cache (built or resumed), the drafter, and the report's held-out prompts."""
        train, held_out = build_datasets(self.job.data, tokenizer)
        self.report_prompts_for(tokenizer, held_out, train)
        reader = self.cached_features(train, tokenizer, self.rcfg.cached_exits(self.m.num_layers))
        dataset = RecordDataset(reader, self.cfg.feature_ids, teacher=self.rcfg.loss != "ce")
        if self.rcfg.feature_scale == "rms":
            self.scale = feature_rms(reader, self.cfg.feature_ids)
        self.draft = DFlashDraft(self.cfg).to(self.m.device)
        return dataset, held_out

    def collator(self, tokenizer, model):
        return functools.partial(collate_records, feature_ids=self.cfg.feature_ids)

    def module(self, model, args) -> DFlashLM:
        r = self.rcfg
        loss = {"kind": r.loss, "gamma": r.gamma, "num_anchors": r.num_anchors, "seed": self.job.seed}
        m = self.m if model is self.m.hf else EarlyExitModel(model)
        return DFlashLM(m, self.draft, loss, self.scale)

    def export(self, run: FinetuneRun):
        """The trained drafter into ``final/`` on rank 0 (native format, the feature scale folded into ``fc``,
        and the drafts per round the engines should run), loaded back (the export check and the report then run the saved drafter, which must
        equal the trained one). Returns the target on rank 0, None elsewhere."""
        trained = self.trained_state(run)
        if trained is None:
            return None
        draft = DFlashDraft(self.cfg)  # on the CPU, whole (ZeRO-3 partitions gathered)
        draft.load_state_dict(trained)
        draft.eval()
        if self.scale is not None:
            fold_feature_scale(draft, self.scale)
        save_dflash(draft, run.stage, speculative_tokens=self.rcfg.drafts, in_place=True)
        loaded, cfg = load_dflash(run.stage)
        live = draft.state_dict()
        if cfg != self.cfg or any(not torch.equal(v, live[k]) for k, v in loaded.state_dict().items()):
            raise RuntimeError(
                f"the drafter saved in {run.stage} does not load back equal to the trained one"
            )
        self.draft = loaded.float().to(self.m.device)
        self.scale = None  # folded: the export check's module reads the raw features
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
        log.info("%s", table_text(self.figures, "DFlash block drafting"))
        return out | {"acceptance": self.figures}

    def drafter_record(self, figures: dict, machine: str):
        return drafter_record(figures, machine, "dflash")


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Cache the target's features (or reuse them), train the drafter, save it, measure it. Returns the
    summary (also ``summary.json``)."""
    return finetune(job, cfg, DFlashRecipe(job)).summary
