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
from pathlib import Path
from typing import Any

import torch

from eagle3_train.config import Eagle3RecipeConfig
from eagle3_train.module import Eagle3LM, collate_examples, collate_records
from eagle3_train.report import drafter_record, measure, table_text
from eagle3_train.trainer import Eagle3Trainer
from fastdecode.api import DRAFTER_CORPUS
from fastdecode.config import ConfigError, group_choices, load_group, to_dataclass, unknown_name_error
from fastdecode.data.chat import IGNORE_INDEX, build_datasets
from fastdecode.data.config import DataConfig
from fastdecode.data.draft_vocab import build_draft_vocab
from fastdecode.data.twins import drop_twins, prompt_keys
from fastdecode.drafters.eagle3.files import load_eagle3, save_eagle3
from fastdecode.drafters.eagle3.model import Eagle3Config, Eagle3Head
from fastdecode.files.distributed import is_main_process
from fastdecode.plan.acceptance import write_record
from fastdecode.registry import corpus_fingerprint
from fastdecode.runtime.identity import weights_fingerprint
from fastdecode.runtime.machine import machine_label
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.tokens import eos_ids
from fastdecode.training.answers import generated_answers, save_corpus
from fastdecode.training.features import FeatureDataset, cache_training_features, generation_prompts
from recipes.common import TrainJob, full_state_dict
from recipes.finetune import FinetuneRun, Recipe, finetune

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


class Eagle3Recipe(Recipe):
    """The head beside a frozen target: the features are the Trainer's dataset (or computed per batch), the
    export is the head in both serving dialects, never the target."""

    trainer_class = Eagle3Trainer
    checkpoints_the_model = False  # the head only

    def __init__(self, job: TrainJob) -> None:
        super().__init__(job)
        self.rcfg = to_dataclass(Eagle3RecipeConfig, job.recipe, "recipe")
        self.m: EarlyExitModel | None = None
        self.head: Eagle3Head | None = None
        self.cfg: Eagle3Config | None = None
        self.aux: list[int] = []
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
                "recipe=eagle3 trains a draft head beside a frozen target: set peft=none (LoRA would change "
                "the target the head drafts for)."
            )
        if self.rcfg.features.mode == "online" and self.job.data.packing:
            raise ConfigError(
                "recipe.features.mode=online needs one conversation per row: set data.packing=false."
            )
        if self.rcfg.report.enabled and self.rcfg.report.data is not None:
            if self.rcfg.report.data not in group_choices("data"):
                raise unknown_name_error(
                    "recipe.report.data", self.rcfg.report.data, group_choices("data"), "(configs/data)"
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

    def loaded(self, model, tokenizer) -> None:
        model.requires_grad_(False)
        model.eval()
        self.base_hash = weights_fingerprint(model, full=True)
        self.m = EarlyExitModel(model)

    def datasets(self, tokenizer) -> tuple[Any, list[dict]]:
        """The training set (the feature cache, built or resumed, or the conversations in online mode), the
        draft vocabulary from its answers, the head, and the report's held-out prompts."""
        rcfg, m = self.rcfg, self.m
        train, held_out = build_datasets(self.job.data, tokenizer)
        if rcfg.report.enabled:
            self.report_prompts = self._report_prompts(tokenizer, held_out, train)
        if rcfg.features.mode == "cache":
            exits = rcfg.cached_exits(m.num_layers)
            self.reader = cache_training_features(
                m, tokenizer, train, self.feature_dir, rcfg.features, exits=exits, data=self.job.data
            )
            if rcfg.features.source == "generate":  # the corpus beside the head: these answers, no new ones
                prompts = generation_prompts(train, tokenizer, rcfg.features.max_prompt_tokens)
                self.answers = generated_answers(self.reader, prompts, tokenizer)
                self.fingerprint = corpus_fingerprint(tokenizer)
            train = RecordDataset(self.reader, self.aux)
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
        if self.rcfg.features.mode == "online":
            return collate_examples
        return functools.partial(collate_records, exits=self.aux)

    def training_args(self) -> dict:
        return {"remove_unused_columns": False}

    def module(self, model, args) -> Eagle3LM:
        r = self.rcfg
        loss = {"steps": r.ttt_steps, "decay": r.step_decay, "kind": r.loss, "prev_correct": r.prev_correct}
        m = self.m if model is self.m.hf else EarlyExitModel(model)
        return Eagle3LM(m, self.head, self.aux, loss)

    def summary(self) -> dict:
        features = {"mode": self.rcfg.features.mode}
        if self.reader is not None:
            features |= {"dir": str(self.feature_dir), **self.reader.manifest.get("summary", {})}
        final = Path(self.job.output_dir) / "final"
        return {"final": str(final), "features": features, "base_weights_sha256": self.base_hash}

    def export(self, run: FinetuneRun):
        """The trained head (gathered on every rank: ZeRO-3 partitions) into ``final/`` (both dialects) on
        rank 0, loaded back (the export check and the report then run the saved head, which must equal the
        trained one). Returns the target on rank 0, None elsewhere."""
        if weights_fingerprint(self.m.hf, full=True) != self.base_hash:
            raise RuntimeError("the target's weights changed during EAGLE-3 training: they must stay frozen")
        trained = full_state_dict(
            run.trainer.accelerator.unwrap_model(run.trainer.model_wrapped)
        )  # all ranks
        if not is_main_process():
            return None
        head = Eagle3Head(self.cfg)  # on the CPU, whole (ZeRO-3 partitions gathered above)
        head.load_state_dict(
            {k.removeprefix("head."): v for k, v in trained.items() if k.startswith("head.")}
        )
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
        log.info("%s", table_text(self.figures))
        return out | {"acceptance": self.figures}

    def extra_files(self, run: FinetuneRun) -> dict:
        """``acceptance.json``, and ``corpus.sfx``: the answers the target generated for the head's training
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
    """Cache the target's features, train the head, save it in both dialects, measure it. Returns the
    summary (also ``summary.json``)."""
    return finetune(job, cfg, Eagle3Recipe(job)).summary
