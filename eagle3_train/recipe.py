"""``recipe=eagle3``: an EAGLE-3 draft head for a frozen target (Li et al., 2025, "Scaling up Inference
Acceleration of Large Language Models via Training-Time Test").

``Eagle3Recipe`` runs the ``recipes.finetune`` sequence with ``Eagle3LM`` under ``Eagle3Trainer``: the
target's features are the training data, the head is trained with the training-time-test loss, and the
export is ``final/`` in the speculators dialect with ``final/sglang/``, never the target. Acceptance goes to
``final/acceptance.json``; the target's generated training answers to ``final/corpus.sfx`` (a suffix decoding
corpus ``auto`` reads beside the head). The steps are in docs/design/methods.md.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from eagle3_train.config import Eagle3RecipeConfig
from eagle3_train.module import Eagle3LM, collate_examples, collate_records
from eagle3_train.report import measure
from eagle3_train.trainer import Eagle3Trainer
from fastdecode.config import ConfigError, to_dataclass
from fastdecode.data.chat import IGNORE_INDEX, build_datasets
from fastdecode.data.draft_vocab import build_draft_vocab
from fastdecode.drafters.eagle3.files import load_eagle3, save_eagle3
from fastdecode.drafters.eagle3.model import Eagle3Config, Eagle3Head
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.tokens import eos_ids
from fastdecode.training.drafter_report import drafter_record, table_text
from fastdecode.training.features import FeatureDataset
from recipes.common import TrainJob
from recipes.finetune import FinetuneRun, finetune
from recipes.frozen_target import FrozenTargetRecipe

log = logging.getLogger(__name__)


class RecordDataset(FeatureDataset):
    """The cached records with what the head needs: the feature layers, the tokens, the teacher."""

    def __init__(self, reader, exits: list[int]) -> None:
        super().__init__(reader, exits, "full")
        self.fields.append("input_ids")


def answer_tokens(train: Any) -> list[list[int]]:
    """The tokens the head will draft: each cached record's answers (``targets``), or each conversation's
    labelled tokens (online mode)."""
    if isinstance(train, FeatureDataset):
        return [train.reader.read(i, ["targets"])["targets"].tolist() for i in range(len(train))]
    return [[t for t in ex["labels"] if t != IGNORE_INDEX] for ex in train]


def draft_vocabulary(train: Any, tokenizer: Any, size: int, vocab_size: int) -> list[int]:
    """Exactly ``size`` target ids: the tokenizer's special ids, then the most frequent tokens of the training
    answers, then (when the answers hold fewer distinct tokens) the smallest ids not yet in."""
    special = [*getattr(tokenizer, "all_special_ids", []), getattr(tokenizer, "eos_token_id", None)]
    ids = build_draft_vocab(answer_tokens(train), size, always=[i for i in special if i is not None]).tolist()
    chosen = set(ids)
    filler = (i for i in range(vocab_size) if i not in chosen)
    return ids + [next(filler) for _ in range(size - len(ids))]


class Eagle3Recipe(FrozenTargetRecipe):
    """The head beside a frozen target (``recipes.frozen_target``): the features are the Trainer's dataset
    (or computed per batch), the export is the head in both serving dialects."""

    trainer_class = Eagle3Trainer
    drafter_name = "EAGLE-3 head"
    state_prefix = "head."

    def __init__(self, job: TrainJob) -> None:
        super().__init__(job)
        self.rcfg = to_dataclass(Eagle3RecipeConfig, job.recipe, "recipe")
        self.head: Eagle3Head | None = None
        self.cfg: Eagle3Config | None = None
        self.aux: list[int] = []

    def prepare(self) -> None:
        super().prepare()
        if self.rcfg.features.mode == "online" and self.job.data.packing:
            raise ConfigError(
                "recipe.features.mode=online needs one conversation per row: set data.packing=false."
            )

    def validate(self, config) -> None:
        self.rcfg.validate(config)
        self.aux = self.rcfg.aux_layers(config.num_hidden_layers)
        r = self.rcfg
        self.cfg = Eagle3Config.from_target(
            config,
            draft_vocab_size=r.draft_vocab_size,
            aux_layer_ids=self.aux,
            fc_norm=r.fc_norm,
            norm_before_fc=r.norm_before_fc,
            norm_before_residual=r.norm_before_residual,
        )

    def datasets(self, tokenizer) -> tuple[Any, list[dict]]:
        """The training set (the feature cache, built or resumed, or the conversations in online mode), the
        draft vocabulary from its answers, the head, and the report's held-out prompts."""
        train, held_out = build_datasets(self.job.data, tokenizer)
        self.report_prompts_for(tokenizer, held_out, train)
        if self.rcfg.features.mode == "cache":
            reader = self.cached_features(train, tokenizer, self.rcfg.cached_exits(self.m.num_layers))
            train = RecordDataset(reader, self.aux)
        self.head = self._build_head(
            draft_vocabulary(train, tokenizer, self.cfg.draft_vocab_size, self.cfg.vocab_size)
        )
        return train, held_out

    def _build_head(self, vocab: list[int]) -> Eagle3Head:
        head = Eagle3Head(self.cfg)
        head.set_draft_vocab(vocab)
        head = head.to(self.m.device)
        if self.rcfg.init == "target_head":
            rows = head.draft_to_target(torch.arange(self.cfg.draft_vocab_size, device=self.m.device))
            with torch.no_grad():
                head.lm_head.weight.copy_(self.m.lm_head.weight[rows].float())
        return head

    def collator(self, tokenizer, model):
        if self.rcfg.features.mode == "online":
            return collate_examples
        return functools.partial(collate_records, exits=self.aux)

    def module(self, model, args) -> Eagle3LM:
        r = self.rcfg
        loss = {"steps": r.ttt_steps, "decay": r.step_decay, "kind": r.loss, "prev_correct": r.prev_correct}
        m = self.m if model is self.m.hf else EarlyExitModel(model)
        return Eagle3LM(m, self.head, self.aux, loss)

    def export(self, run: FinetuneRun):
        """The trained head into ``final/`` (both dialects) on rank 0, loaded back (the export check and the
        report then run the saved head, which must equal the trained one). Returns the target on rank 0,
        None elsewhere."""
        trained = self.trained_state(run)
        if trained is None:
            return None
        head = Eagle3Head(self.cfg)  # on the CPU, whole (ZeRO-3 partitions gathered)
        head.load_state_dict(trained)
        head.eval()
        save_eagle3(
            head,
            self.cfg,
            run.stage,
            verifier_name=self.job.model.name_or_path or self.job.model.name,
            speculative_tokens=self.rcfg.speculative_tokens,
            in_place=True,
        )
        loaded, cfg = load_eagle3(run.stage)
        live = head.state_dict()
        if cfg != self.cfg or any(not torch.equal(v, live[k]) for k, v in loaded.state_dict().items()):
            raise RuntimeError(f"the head saved in {run.stage} does not load back equal to the trained head")
        self.head = loaded.float().to(self.m.device)
        return self.m.hf

    def after_report(self, run: FinetuneRun) -> dict:
        out = {"head": str(run.out / "final"), "aux_layer_ids": self.aux, "base_weights_unchanged": True}
        if not self.report_prompts:
            return out
        r = self.rcfg.report
        self.figures = measure(
            self.head,
            self.m,
            self.report_prompts,
            self.aux,
            max_new_tokens=r.max_new_tokens,
            batch_size=r.batch_size,
            eos=eos_ids(self.m.hf, run.tokenizer),
        )
        log.info("%s", table_text(self.figures, "EAGLE-3 chain drafting"))
        return out | {"acceptance": self.figures}

    def drafter_record(self, figures: dict, machine: str):
        return drafter_record(figures, machine, "eagle3")


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Cache the target's features, train the head, save it in both dialects, measure it. Returns the
    summary (also ``summary.json``)."""
    return finetune(job, cfg, Eagle3Recipe(job)).summary
