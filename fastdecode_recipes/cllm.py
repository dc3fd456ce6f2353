"""``recipe=cllm``: consistency training (CLLM, Kou et al., 2024) on Jacobi trajectories of the same model.

trajectories (checked against the tokenizer before the weights load) -> examples -> model -> (LoRA) ->
held-out perplexity + Jacobi tokens per forward (before) -> CLLMTrainer -> train -> export (verified against
the live model) -> the same measurement (after) -> ``summary.json``. The exported checkpoint is a plain HF
directory; decode it with ``fastdecode.decoding.get_decoder("jacobi")``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from pathlib import Path
from typing import Any

import torch

from cllm_train.config import CLLMConfig
from cllm_train.dataset import build_examples, collate, load_trajectories
from cllm_train.module import ConsistencyLM
from cllm_train.records import model_identity
from cllm_train.trainer import CLLMTrainer
from fastdecode.config import to_dataclass
from fastdecode.data.chat import build_datasets, user_prompt_ids
from fastdecode.decoding import DecodeConfig, get_decoder
from fastdecode.distributed import is_main_process
from fastdecode.io import atomic_directory, atomic_write_json, save_resolved_config
from fastdecode.loading import load_model, load_tokenizer, resolve_device
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
)
from fastdecode_recipes.resume import train as train_or_finish

log = logging.getLogger(__name__)


def _tokenizer(job: TrainJob):
    """The model's tokenizer without its weights (a packaged GGUF is converted once, then cached)."""
    from fastdecode.assets import model_load_path

    path = None if job.model.source == "random" or job.model.tokenizer else model_load_path(job.model)
    return load_tokenizer(job.model, path)


def _held_out(job: TrainJob, rcfg: CLLMConfig, tokenizer, trained_ids: set[str]) -> list[dict]:
    """Held-out conversations of the data group, minus any prompt the trajectories were collected from."""
    if not rcfg.report.enabled:
        return []
    _, held = build_datasets(dataclasses.replace(job.data, max_samples=1), tokenizer)  # held-out part only
    kept = [ex for ex in held if str(ex["id"]) not in trained_ids]
    if len(kept) < len(held):
        log.warning(
            "report: %d held-out conversations are in the trajectories; left out", len(held) - len(kept)
        )
    return kept


@torch.no_grad()
def perplexity(model, examples: list[dict]) -> float | None:
    """Perplexity of the assistant tokens (``labels``) of tokenized examples, one conversation at a time."""
    nll, tokens = 0.0, 0
    for ex in examples:
        ids = torch.tensor([ex["input_ids"]], device=model.device)
        targets = torch.tensor(ex["labels"][1:], device=model.device)
        logits = model(input_ids=ids).logits[0, :-1].float()  # [T-1, V]: position t predicts t+1
        nll += torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
        tokens += int((targets != -100).sum())
    return math.exp(nll / tokens) if tokens else None


def measure(model, tokenizer, held_out: list[dict], rcfg: CLLMConfig, block: int) -> dict:
    """Held-out perplexity and greedy Jacobi decoding of held-out prompts (batch 1, like the reference)."""
    r = rcfg.report
    model.eval()
    m = EarlyExitModel(model)
    cfg = DecodeConfig(
        max_new_tokens=r.max_new_tokens, jacobi_block=block, eos_token_id=tokenizer.eos_token_id
    )
    tokens = forwards = 0
    fast_forward: list[int] = []
    for ex in [ex for ex in held_out if ex.get("prompt")][: r.prompts]:
        out = get_decoder("jacobi")(m, [user_prompt_ids(tokenizer, ex["prompt"])], cfg)
        tokens, forwards = tokens + out.num_tokens, forwards + out.steps
        fast_forward += out.fast_forward
    return {
        "perplexity": perplexity(model, held_out[: r.held_out_examples]),
        "held_out_examples": min(len(held_out), r.held_out_examples),
        "jacobi_block": block,
        "jacobi_tokens": tokens,
        "tokens_per_forward": tokens / forwards if forwards else None,
        "mean_fast_forward": sum(fast_forward) / len(fast_forward) if fast_forward else None,
    }


def _check_export(final, probe: dict, live_loss: float, rcfg: CLLMConfig, seed: int, live_dtype) -> dict:
    """The saved checkpoint must reproduce the live model's CLLM loss on a probe batch (same state draw)."""
    with torch.no_grad():
        saved = float(ConsistencyLM(final, rcfg, seed).eval()(**probe)["loss"])
    return compare_export(saved, live_loss, live_dtype)


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Train on ``recipe.trajectories``, export, measure. Returns the checkpoint path, metrics and report."""
    from transformers import set_seed

    rcfg = to_dataclass(CLLMConfig, job.recipe, "recipe")
    check_deepspeed_batch(job)
    set_seed(job.seed)
    tokenizer = _tokenizer(job)
    manifest, records = load_trajectories(
        rcfg.trajectories, tokenizer, model_identity(job.model), rcfg.max_records
    )
    train = build_examples(records, rcfg)
    held_out = _held_out(job, rcfg, tokenizer, {r["prompt_id"] for r in records})
    block = rcfg.report.block_size or max(len(r["fixed_point"]) for r in records)
    model, tokenizer = load_model(job.model)
    out = Path(job.output_dir)
    if cfg is not None:
        save_resolved_config(cfg, out)
    want_before = rcfg.report.enabled and rcfg.report.before and is_main_process()
    before = measure(model, tokenizer, held_out, rcfg, block) if want_before else None
    args = training_arguments(job, prediction_loss_only=True)
    model = apply_peft(model, job.peft, args.gradient_checkpointing)
    seed = job.seed if rcfg.seed is None else rcfg.seed
    collator = functools.partial(
        collate, pad_id=tokenizer.pad_token_id, ar_from_teacher=rcfg.ar_target == "fixed_point"
    )
    trainer = CLLMTrainer(
        model=ConsistencyLM(model, rcfg, seed),
        args=args,
        train_dataset=train,
        data_collator=collator,
        draw_base=seed,
    )
    result = train_or_finish(trainer, resolve_resume(job))
    probe = collator(train[:2])
    live_loss = probe_loss(trainer, probe)  # every rank: ZeRO-3 gathers the partitions for this forward
    summary = {
        "checkpoint": str(out / "final"),
        "metrics": dict(result.metrics),
        "trajectories": {"path": str(rcfg.trajectories), "records": len(records), "model": manifest["model"]},
    }
    with atomic_directory(out / "final", main_process=is_main_process(), fault="export") as stage:
        final = export_checkpoint(trainer, model, tokenizer, job.peft, stage)
        if final is not None:  # rank 0: verified before final/ appears
            summary["export_check"] = _check_export(final, probe, live_loss, rcfg, seed, model.dtype)
    if final is not None:
        if rcfg.report.enabled:
            final.to(resolve_device(job.model.device))
            after = measure(final, tokenizer, held_out, rcfg, block)
            summary["report"] = {"before": before, "after": after}
            log.info("cllm: before %s, after %s", before, after)
        atomic_write_json(out / "summary.json", summary)
    return summary
