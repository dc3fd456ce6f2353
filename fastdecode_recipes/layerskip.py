"""``recipe=layerskip``: layer dropout + early-exit loss (Elhoushi et al., 2024) on the HF Trainer.

model -> (LoRA) -> data -> exit report (before) -> LayerSkipTrainer -> train -> export -> exit report
(after) -> recommended exit E in ``generation_config.assistant_early_exit``. The exported checkpoint is a
plain HF directory: ``AutoModelForCausalLM`` + ``generate(assistant_early_exit=E)`` self-speculates with it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

from fastdecode.config import ConfigError, group_choices, load_group, to_dataclass, unknown_name_error
from fastdecode.data.chat import build_datasets, collate, user_prompt_ids
from fastdecode.data.config import DataConfig
from fastdecode.decoding import DecodeConfig, get_decoder
from fastdecode.distributed import is_main_process
from fastdecode.draft_vocab import DRAFT_VOCAB_FILE, draft_vocab_from_examples, save_draft_vocab
from fastdecode.exit_report import choose_exit, exit_report, head_cost_in_blocks, plot_reports
from fastdecode.io import atomic_directory, atomic_write_json, save_resolved_config
from fastdecode.loading import load_model, model_config
from fastdecode.model import EarlyExitModel
from fastdecode_recipes.common import (
    TrainJob,
    apply_peft,
    check_deepspeed_batch,
    compare_export,
    export_checkpoint,
    probe_loss,
    resolve_resume,
    training_arguments,
    world_size,
)
from fastdecode_recipes.resume import train as train_or_finish
from layerskip_train.config import LayerSkipConfig
from layerskip_train.early_exit_loss import scale_weights
from layerskip_train.layer_dropout import dropout_rates, parse_layers
from layerskip_train.module import EarlyExitLM
from layerskip_train.trainer import LayerSkipTrainer

log = logging.getLogger(__name__)


def validate(rcfg: LayerSkipConfig, num_layers: int) -> None:
    """Every layer index, scale and rate is checked against the model before any training work."""
    ee, ld = rcfg.early_exit_loss, rcfg.layer_dropout
    exits = parse_layers(ee.layers, num_layers)
    scale_weights(ee.scale_fn, sorted(set(exits) | {num_layers - 1}), num_layers, ee.scale)
    dropout_rates(ld.prob, num_layers, ld.layers, ld.layers_scale, ld.time_scale, 0, 1)
    if rcfg.report.data is not None and rcfg.report.data not in group_choices("data"):
        raise unknown_name_error(
            "recipe.report.data", rcfg.report.data, group_choices("data"), "(configs/data)"
        )
    if rcfg.exit_layer is not None and not 1 <= rcfg.exit_layer < num_layers:
        raise ConfigError(
            f"recipe.exit_layer={rcfg.exit_layer} must be in [1, {num_layers - 1}] (blocks run)."
        )


def _report_set(rcfg: LayerSkipConfig, tokenizer, held_out: list[dict]) -> list[dict]:
    """The report's held-out examples: the training data's, or those of ``report.data`` (a data config)."""
    if rcfg.report.data is None or not rcfg.report.enabled:
        return held_out
    data = load_group("data", rcfg.report.data, DataConfig, max_samples=1)
    return build_datasets(data, tokenizer)[1]


def _report(model, tokenizer, held_out: list[dict], rcfg: LayerSkipConfig) -> dict:
    r = rcfg.report
    prompts = [ex["prompt"] for ex in held_out if ex.get("prompt")][: r.prompts]
    return exit_report(model, tokenizer, held_out, prompts, r.max_new_tokens, r.held_out_examples)


def _exit_chunks(job: TrainJob, rcfg: LayerSkipConfig) -> int | None:
    """Multi-process: a fixed chunk count per exit, sized for the largest possible batch (see EarlyExitLM)."""
    if world_size() == 1:
        return None
    batch = max(
        job.trainer.get("per_device_train_batch_size", 8), job.trainer.get("per_device_eval_batch_size", 8)
    )
    return max(1, -(-batch * job.data.max_length // rcfg.early_exit_loss.chunk_size))


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Train, export, report. Returns the checkpoint path, metrics and the recommended exit."""
    from transformers import set_seed

    rcfg = to_dataclass(LayerSkipConfig, job.recipe, "recipe")
    check_deepspeed_batch(job)
    validate(rcfg, model_config(job.model).num_hidden_layers)  # from config.json: before the weights load
    set_seed(job.seed)
    model, tokenizer = load_model(job.model)
    train, held_out = build_datasets(job.data, tokenizer)
    report_set = _report_set(rcfg, tokenizer, held_out)
    out = Path(job.output_dir)
    if cfg is not None:
        save_resolved_config(cfg, out)
    want_before = rcfg.report.enabled and rcfg.report.before and is_main_process()
    before = _report(model, tokenizer, report_set, rcfg) if want_before else None
    args = training_arguments(job, prediction_loss_only=True)
    model = apply_peft(model, job.peft, args.gradient_checkpointing)
    module = EarlyExitLM(model, rcfg, job.seed, args.max_steps, args.process_index, _exit_chunks(job, rcfg))
    trainer = LayerSkipTrainer(
        model=module,
        args=args,
        train_dataset=train,
        eval_dataset=held_out or None,
        data_collator=functools.partial(collate, pad_id=tokenizer.pad_token_id, mask_dtype=model.dtype),
    )
    result = train_or_finish(trainer, resolve_resume(job))
    metrics = dict(result.metrics) | (trainer.evaluate() if held_out else {})
    probe = collate(held_out[:2] or train[:2], tokenizer.pad_token_id, model.dtype)
    live_loss = probe_loss(trainer, probe)  # every rank: ZeRO-3 gathers the partitions for this forward
    summary = {"checkpoint": str(out / "final"), "metrics": metrics}
    # final/ appears whole, with its recommended exit and draft vocabulary, or not at all
    with atomic_directory(out / "final", main_process=is_main_process(), fault="export") as stage:
        final = export_checkpoint(trainer, model, tokenizer, job.peft, stage)
        if final is not None:  # rank 0
            summary["export_check"] = _check_export(final, probe, live_loss, model.dtype)
            summary |= _finish(final, tokenizer, report_set, rcfg, before, out, stage)
            summary["draft_vocab"] = _write_draft_vocab(train, tokenizer, rcfg, stage, out / "final")
    if final is not None:
        atomic_write_json(out / "summary.json", summary)
    return summary


def _best_found(choice: dict) -> int | None:
    return (choice.get("best_found") or {}).get("exit")


def _speed_line(
    final, tokenizer, held_out: list[dict], rcfg: LayerSkipConfig, exit_layer: int | None
) -> dict:
    """Time self-speculation (adaptive policy) at ``exit_layer`` against autoregressive decoding on a few
    held-out prompts, print one line, return the numbers (empty when there is no exit or no prompt)."""
    r = rcfg.report
    prompts = [ex["prompt"] for ex in held_out if ex.get("prompt")][: r.speed_prompts]
    if exit_layer is None or not prompts:
        return {}
    ids = [user_prompt_ids(tokenizer, p) for p in prompts]
    m = EarlyExitModel(final)
    base = DecodeConfig(max_new_tokens=r.speed_new_tokens, eos_token_id=tokenizer.eos_token_id)
    spec = dataclasses.replace(base, exit_layer=exit_layer, policy="adaptive", draft_tokens=r.max_draft)
    result = {}
    for name, cfg in (("autoregressive", base), ("self_speculative", spec)):
        get_decoder(name)(m, ids[:1], dataclasses.replace(cfg, max_new_tokens=2))  # warm-up
        start = time.perf_counter()
        outs = [get_decoder(name)(m, [p], cfg) for p in ids]
        seconds = time.perf_counter() - start
        tokens = sum(o.num_tokens for o in outs)
        result[name] = {"tokens_per_s": tokens / seconds, "tokens": tokens}
    accepted = sum(sum(o.accepted) for o in outs) / max(1, sum(sum(o.drafted) for o in outs))
    result |= {"exit": exit_layer, "acceptance": accepted}
    result["speedup"] = result["self_speculative"]["tokens_per_s"] / result["autoregressive"]["tokens_per_s"]
    line = (
        f"self-speculation at E={exit_layer}: {result['self_speculative']['tokens_per_s']:.1f} tok/s vs "
        f"autoregressive {result['autoregressive']['tokens_per_s']:.1f} tok/s ({result['speedup']:.2f}x, "
        f"acceptance {accepted:.2f}; {len(ids)} held-out prompts, greedy, batch 1)"
    )
    log.info(line)
    print(line)
    return result


def _write_draft_vocab(
    train: list[dict], tokenizer, rcfg: LayerSkipConfig, stage: Path, final_dir: Path
) -> str | None:
    """``draft_vocab.json`` next to the checkpoint (``decoder.draft_vocab=<it>`` makes drafting cheaper),
    written into the export's staging directory ``stage``; returns its path once published in ``final_dir``."""
    size, vocab = rcfg.draft_vocab_size, len(tokenizer)
    if size is None or size >= vocab:
        return None
    ids = draft_vocab_from_examples(train, tokenizer, size)
    save_draft_vocab(stage / DRAFT_VOCAB_FILE, ids, vocab_size=vocab, source="training data")
    return str(final_dir / DRAFT_VOCAB_FILE)


def _check_export(final, probe: dict, live_loss: float, live_dtype) -> dict:
    """The saved checkpoint must reproduce the live model (catches partial ZeRO-3 saves, lost LoRA merges)."""
    import torch

    with torch.no_grad():
        logits = final(
            input_ids=probe["input_ids"],
            attention_mask=probe["attention_mask"],
            position_ids=probe["position_ids"],
        ).logits
        shifted = torch.nn.functional.pad(probe["labels"][:, 1:], (0, 1), value=-100)
        saved = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten()).item()
    return compare_export(saved, live_loss, live_dtype)


def _finish(
    final, tokenizer, held_out, rcfg: LayerSkipConfig, before: dict | None, out: Path, stage: Path
) -> dict:
    """Exit report after training, the recommended exit in generation_config (in the export's staging
    directory ``stage``), report JSON + plot."""
    num_layers = final.config.num_hidden_layers
    after = _report(final, tokenizer, held_out, rcfg) if rcfg.report.enabled else None
    if rcfg.exit_layer is not None:
        choice = {"exit": rcfg.exit_layer, "source": "config"}
    elif after is not None:
        agreement, head = after["generations"]["agreement"], head_cost_in_blocks(final)
        choice = choose_exit(agreement, num_layers, rcfg.report.max_draft, head_cost=head)
        choice["source"] = "exit report"
    else:
        choice = {"exit": None, "source": "no report"}
    if choice["exit"] is not None:  # plain transformers users then self-speculate with generate()
        final.generation_config.assistant_early_exit = int(choice["exit"])
        final.generation_config.save_pretrained(str(stage))
        log.info("recommended exit E=%s (%s)", choice["exit"], choice["source"])
    else:
        log.warning("no exit is expected to speed decoding up yet (%s); assistant_early_exit not set", choice)
    report = {"before": before, "after": after, "recommended": choice}
    report["speed"] = _speed_line(final, tokenizer, held_out, rcfg, choice.get("exit") or _best_found(choice))
    atomic_write_json(out / "exit_report.json", report)
    if before and after:
        plot_reports({"before": before, "after": after}, str(out / "exit_report.png"))
    return {"recommended_exit": choice, "exit_report": str(out / "exit_report.json")}
