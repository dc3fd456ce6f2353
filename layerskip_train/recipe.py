"""``recipe=layerskip``: layer dropout + early-exit loss (Elhoushi et al., 2024) on the HF Trainer.

The ``recipes.finetune`` sequence with ``EarlyExitLM`` under ``LayerSkipTrainer``: exit report
(before) -> train -> export (verified) -> exit report (after) -> recommended exit E in ``fastdecode.json``
-> ``draft_vocab.json``. The exported checkpoint is a plain HF directory that ``generate`` and ``pipeline``
run at any batch size; ``generate(assistant_early_exit=E)`` self-speculates with it (batch 1), and
``recipe.export.hf_assistant_early_exit=true`` makes that the default of its generation config.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from fastdecode.config import ConfigError, group_choices, load_group, to_dataclass, unknown_name_error
from fastdecode.data.chat import build_datasets
from fastdecode.data.config import DataConfig
from fastdecode.data.draft_vocab import draft_vocab_from_examples
from fastdecode.files.distributed import world_size
from fastdecode.files.draft_vocab_file import DRAFT_VOCAB_FILE, save_draft_vocab
from fastdecode.files.io import atomic_write_json
from fastdecode.plan.acceptance import exit_record, read_record, write_record
from fastdecode.plan.choose import Plan, choose_exit, plan_decoding
from fastdecode.plan.cost import decoding_costs
from fastdecode.reports.exits import choice_sentence, exit_report, plot_reports
from fastdecode.runtime.machine import machine_label
from fastdecode.runtime.model import EarlyExitModel
from layerskip_train.config import LayerSkipConfig
from layerskip_train.early_exit_loss import CURRICULUM_ALIASES, active_exits, scale_weights
from layerskip_train.layer_dropout import dropout_rates, parse_layers
from layerskip_train.module import EarlyExitLM
from layerskip_train.trainer import LayerSkipTrainer
from recipes.common import TrainJob
from recipes.finetune import FinetuneRun, Recipe, finetune
from recipes.speed import speed_line

log = logging.getLogger(__name__)


def validate(rcfg: LayerSkipConfig, num_layers: int) -> None:
    """Every layer index, scale and rate is checked against the model before any training work."""
    ee, ld = rcfg.early_exit_loss, rcfg.layer_dropout
    exits = parse_layers(ee.layers, num_layers)
    scale_weights(ee.scale_fn, sorted(set(exits) | {num_layers - 1}), num_layers, ee.scale)
    dropout_rates(
        ld.prob, num_layers, ld.layers, scale=ld.layers_scale, time_scale=ld.time_scale, step=0, total_steps=1
    )
    if rcfg.report.data is not None and rcfg.report.data not in group_choices("data"):
        raise unknown_name_error(
            "recipe.report.data", rcfg.report.data, group_choices("data"), "(configs/data)"
        )
    if rcfg.exit_layer is not None and not 1 <= rcfg.exit_layer < num_layers:
        raise ConfigError(
            f"recipe.exit_layer={rcfg.exit_layer} must be in [1, {num_layers - 1}] (blocks run)."
        )
    warn_empty_steps(rcfg, num_layers)
    log.info(
        "exit losses are logged as loss/exit_E with E = blocks run = layer index + 1 (recipe.early_exit_loss."
        "layers counts 0-based blocks; recipe.exit_layer and fastdecode.json count E): layers %s -> %s",
        ee.layers,
        ", ".join(f"loss/exit_{layer + 1}" for layer in sorted(set(exits) | {num_layers - 1})),
    )


def warn_empty_steps(rcfg: LayerSkipConfig, num_layers: int) -> int:
    """Warn once when the curriculum leaves steps with no exit loss but the last layer's (a sparse
    ``layers`` slice under ``strided``/``rotational``); returns how many steps of one period do."""
    ee = rcfg.early_exit_loss
    curriculum = CURRICULUM_ALIASES.get(ee.curriculum, ee.curriculum)
    candidates = [layer for layer in parse_layers(ee.layers, num_layers) if layer != num_layers - 1]
    if curriculum not in ("strided", "rotational") or not candidates:
        return 0
    period = ee.stride if curriculum == "strided" else num_layers
    empty = sum(
        active_exits(curriculum, candidates, num_layers, step, 1, stride=ee.stride) == [num_layers - 1]
        for step in range(period)
    )
    if empty:
        log.warning(
            "recipe.early_exit_loss: layers=%r with curriculum=%s trains no exit but the last at %d of every %d "
            "steps (those steps are plain fine-tuning); use a denser layers slice, a smaller stride, or "
            "curriculum=none to train every candidate at every step",
            ee.layers,
            ee.curriculum,
            empty,
            period,
        )
    return empty


def _report_set(rcfg: LayerSkipConfig, tokenizer, held_out: list[dict]) -> list[dict]:
    """The report's held-out examples: the training data's, or those of ``report.data`` (a data config)."""
    if rcfg.report.data is None or not rcfg.report.enabled:
        return held_out
    data = load_group("data", rcfg.report.data, DataConfig, max_samples=1)
    return build_datasets(data, tokenizer)[1]


def _report(model, tokenizer, held_out: list[dict], rcfg: LayerSkipConfig, when: str, vocab=None) -> dict:
    r = rcfg.report
    prompts = [ex["prompt"] for ex in held_out if ex.get("prompt")][: r.prompts]
    return exit_report(
        model,
        tokenizer,
        held_out,
        prompts,
        r.max_new_tokens,
        max_examples=r.held_out_examples,
        name=f"exit report {when} training",
        vocab=vocab,
    )


def _exit_chunks(job: TrainJob, rcfg: LayerSkipConfig) -> int | None:
    """Multi-process: a fixed chunk count per exit, sized for the largest possible batch (see EarlyExitLM)."""
    if world_size() == 1:
        return None
    batch = max(
        job.trainer.get("per_device_train_batch_size", 8), job.trainer.get("per_device_eval_batch_size", 8)
    )
    return max(1, -(-batch * job.data.max_length // rcfg.early_exit_loss.chunk_size))


class LayerSkip(Recipe):
    """``EarlyExitLM`` under ``LayerSkipTrainer``; exit reports before and after, the exit choice, the draft
    vocabulary."""

    trainer_class = LayerSkipTrainer

    def __init__(self, job: TrainJob) -> None:
        super().__init__(job)
        self.rcfg = to_dataclass(LayerSkipConfig, job.recipe, "recipe")
        self.report_set: list[dict] = []

    def validate(self, config) -> None:
        validate(self.rcfg, config.num_hidden_layers)

    def datasets(self, tokenizer) -> tuple[list[dict], list[dict]]:
        train, held_out = super().datasets(tokenizer)
        self.report_set = _report_set(self.rcfg, tokenizer, held_out)
        return train, held_out

    def module(self, model, args) -> EarlyExitLM:
        return EarlyExitLM(
            model,
            self.rcfg,
            seed=self.job.seed,
            total_steps=args.max_steps,
            rank=args.process_index,
            exit_chunks=_exit_chunks(self.job, self.rcfg),
        )

    def before_report(self, model, tokenizer, held_out: list[dict]) -> dict | None:
        r = self.rcfg.report
        if not (r.enabled and r.before):
            return None
        return _report(model, tokenizer, self.report_set, self.rcfg, "before")

    def after_report(self, run: FinetuneRun) -> dict:
        vocab = _write_draft_vocab(run.train, run.tokenizer, self.rcfg, run.stage)
        return _finish(run, self.report_set, self.rcfg, vocab)

    def extra_files(self, run: FinetuneRun) -> dict:
        written = (run.stage / DRAFT_VOCAB_FILE).is_file()
        return {"draft_vocab": str(run.out / "final" / DRAFT_VOCAB_FILE) if written else None}

    def describe(self, run: FinetuneRun) -> dict:
        choice = run.summary.get("recommended_exit") or {}
        return {"exit_layer": choice.get("exit"), "exit_source": choice.get("source")}


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Train, export, report. Returns the checkpoint path, metrics and the recommended exit."""
    return finetune(job, cfg, LayerSkip(job)).summary


def _speed_line(m: EarlyExitModel, tokenizer, held_out: list[dict], rcfg: LayerSkipConfig, plan: Plan):
    """The closing speed table: the decoders the cost model expects to pay with the acceptance this
    checkpoint records (``plan``: ``fastdecode.plan.choose.plan_decoding`` on the record in the export's staging
    directory) against autoregressive decoding, on a few held-out prompts."""
    prompts = [ex["prompt"] for ex in held_out if ex.get("prompt")]
    return speed_line(m, tokenizer, prompts, rcfg.report, plan)


def _write_draft_vocab(
    train: list[dict], tokenizer, rcfg: LayerSkipConfig, stage: Path
) -> torch.Tensor | None:
    """``draft_vocab.json`` in the export's staging directory ``stage`` (``decoder.draft_vocab=<it>`` makes
    drafting cheaper); its ids, or None when the configured size keeps the whole vocabulary."""
    size, vocab = rcfg.draft_vocab_size, len(tokenizer)
    if size is None or size >= vocab:
        return None
    ids = draft_vocab_from_examples(train, tokenizer, size)
    save_draft_vocab(stage / DRAFT_VOCAB_FILE, ids, vocab_size=vocab, source="training data")
    return torch.as_tensor(ids, dtype=torch.long)


def exit_message(choice: dict, plan: Plan | None, measured_on: str | None = None) -> str:
    """The exit choice as one sentence: what was recorded, why, and what ``method=auto`` decodes with."""
    exit_layer = choice["exit"]
    if choice["source"] == "config":
        text = f"exit E={exit_layer} from recipe.exit_layer, recorded in fastdecode.json"
    elif choice["source"] == "no report":
        text = "no exit recorded: the exit report is off (recipe.report.enabled=false)"
    else:
        text = choice_sentence(choice, measured_on)
        text += "; no exit recorded" if exit_layer is None else ", recorded in fastdecode.json"
    if plan is not None:
        text += f"; method=auto decodes with {plan.best.name.replace('_', ' ')}"
    return text


def _record_exit(final, stage: Path, choice: dict, rcfg: LayerSkipConfig, plan: Plan | None) -> None:
    """E goes into ``fastdecode.json`` (``LayerSkip.describe``); into ``generation_config.json`` only when
    ``recipe.export.hf_assistant_early_exit`` opts in, since transformers then self-speculates inside every
    ``generate`` (batch size 1 only). Without the opt-in, one inherited from the base model is removed too.
    No exit expected to pay is the usual outcome of a short CPU run, so it is logged at INFO like a choice."""
    exit_layer = choice["exit"]
    log.info("%s", exit_message(choice, plan, machine_label(final.device)))
    hf_exit = int(exit_layer) if rcfg.export.hf_assistant_early_exit and exit_layer is not None else None
    if hf_exit is not None or getattr(final.generation_config, "assistant_early_exit", None) is not None:
        final.generation_config.assistant_early_exit = hf_exit
        final.generation_config.save_pretrained(str(stage))
    if hf_exit is not None:
        log.warning(
            "recipe.export.hf_assistant_early_exit=true: generation_config.assistant_early_exit=%d, so plain "
            "transformers generate() self-speculates by default and refuses batches larger than one",
            hf_exit,
        )


def _finish(run: FinetuneRun, held_out, rcfg: LayerSkipConfig, vocab: torch.Tensor | None) -> dict:
    """Exit report after training (per exit, full head and draft vocabulary ``vocab``), the acceptance record
    and the recommended exit (written into the export's staging directory, so ``final/`` carries them), report
    JSON + plot in the run directory, the closing speed table."""
    final, tokenizer, stage, out = run.final, run.tokenizer, run.stage, run.out
    after = _report(final, tokenizer, held_out, rcfg, "after", vocab) if rcfg.report.enabled else None
    generations = after["generations"] if after is not None else None
    agreement = generations["agreement"] if generations is not None else None
    m = EarlyExitModel(final)
    costs = decoding_costs(m) if agreement is not None else None
    if generations is not None:
        prompts = min(rcfg.report.prompts, len(held_out))
        measured_on = f"the model's own greedy answers to {prompts} held-out prompts, after training"
        write_record(stage, exit_record(generations, draft_vocab=DRAFT_VOCAB_FILE, measured_on=measured_on))
    plan = plan_decoding(m, costs, record=read_record(stage)) if costs is not None else None
    if rcfg.exit_layer is not None:
        choice = {"exit": rcfg.exit_layer, "source": "config"}
    elif agreement is not None:
        rounds = generations.get("tokens_per_round")
        choice = choose_exit(agreement, costs, rounds=rounds, max_draft=rcfg.report.max_draft)
        choice["source"] = "exit report"
    else:
        choice = {"exit": None, "source": "no report"}
    _record_exit(final, stage, choice, rcfg, plan)
    report = {"before": run.before, "after": after, "recommended": choice}
    if costs is not None:
        report["costs"] = costs.to_json() | {
            "measured_on": machine_label(m.device)
        }  # speeds name the machine
        report["speed"] = _speed_line(m, tokenizer, held_out, rcfg, plan)
    atomic_write_json(out / "exit_report.json", report)
    if run.before and after:
        plot_reports({"before": run.before, "after": after}, str(out / "exit_report.png"))
    return {
        "recommended_exit": choice,
        "exit_report": str(out / "exit_report.json"),
        "speed": report.get("speed"),
    }
