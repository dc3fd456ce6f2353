"""``recipe=skipdecode``: fine-tune under the SkipDecode policy (Del Corro et al., 2023) on the HF Trainer.

model -> policy check -> (LoRA) -> data -> held-out perplexity under the policy (before) -> Trainer on
``SkipDecodeLM`` (final-layer CE, the policy run exactly in the forward) -> train -> export (verified against
the live model under the policy) -> held-out perplexity (after) -> ``final/skipdecode.json``: the ``decoder``
options (``skip_*`` DecodeConfig fields) that decode with the trained policy.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from fastdecode.config import ConfigError, to_dataclass
from fastdecode.data.chat import build_datasets, collate
from fastdecode.distributed import is_main_process
from fastdecode.io import atomic_directory, atomic_write_json, save_resolved_config
from fastdecode.loading import load_model, model_config
from fastdecode.model import EarlyExitModel
from fastdecode.skipdecode import SkipDecodePolicy
from fastdecode.skipdecode_report import policy_perplexity
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
from skipdecode_train.config import SkipDecodeConfig
from skipdecode_train.module import SkipDecodeLM

log = logging.getLogger(__name__)


def decoder_options(policy: SkipDecodePolicy) -> dict:
    """The ``DecodeConfig`` fields that make ``decoder=skipdecode`` run ``policy``."""
    return {
        "skip_max_budget": policy.max_budget,
        "skip_min_budget": policy.min_budget,
        "skip_warmup_layers": policy.warmup_layers,
        "skip_max_length": policy.max_length,
    }


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Train under the policy, export, measure. Returns the checkpoint path, metrics and the policy."""
    from transformers import Trainer, set_seed

    rcfg = to_dataclass(SkipDecodeConfig, job.recipe, "recipe")
    check_deepspeed_batch(job)
    if job.data.packing:
        raise ConfigError(
            "recipe=skipdecode trains one conversation per row (the budget counts from each response "
            "start); set data.packing=false."
        )
    policy = rcfg.policy(model_config(job.model).num_hidden_layers, job.data.max_length)  # before the weights
    set_seed(job.seed)
    model, tokenizer = load_model(job.model)
    train, held_out = build_datasets(job.data, tokenizer)
    out = Path(job.output_dir)
    if cfg is not None:
        save_resolved_config(cfg, out)
    want_before = rcfg.evaluate_before and held_out and is_main_process()
    before = policy_perplexity(EarlyExitModel(model), lambda _: policy, held_out) if want_before else None
    args = training_arguments(job, prediction_loss_only=True)
    model = apply_peft(model, job.peft, args.gradient_checkpointing)
    module = SkipDecodeLM(model, policy)
    collator = functools.partial(collate, pad_id=tokenizer.pad_token_id, mask_dtype=model.dtype, four_d=False)
    trainer = Trainer(
        model=module, args=args, train_dataset=train, eval_dataset=held_out or None, data_collator=collator
    )
    result = train_or_finish(trainer, resolve_resume(job))
    metrics = dict(result.metrics) | (trainer.evaluate() if held_out else {})
    probe = collator(held_out[:2] or train[:2])
    live_loss = probe_loss(trainer, probe)  # every rank: ZeRO-3 gathers the partitions for this forward
    summary = {"checkpoint": str(out / "final"), "metrics": metrics, "policy": decoder_options(policy)}
    with atomic_directory(out / "final", main_process=is_main_process(), fault="export") as stage:
        final = export_checkpoint(trainer, model, tokenizer, job.peft, stage)
        if final is not None:  # rank 0: verified, with its decoder options, before final/ appears
            exported = SkipDecodeLM(final, policy).eval()
            summary["export_check"] = _check_export(exported, probe, live_loss, model.dtype)
            options = {"decoder": "skipdecode", "num_layers": policy.num_layers, **decoder_options(policy)}
            atomic_write_json(stage / "skipdecode.json", options)
    if final is not None:
        after = policy_perplexity(exported.adapter, lambda _: policy, held_out) if held_out else None
        summary["held_out"] = {"before": before, "after": after}
        atomic_write_json(out / "summary.json", summary)
        log.info("skipdecode done: %s", summary["held_out"])
    return summary


def _check_export(exported: SkipDecodeLM, probe: dict, live_loss: float, live_dtype) -> dict:
    """The saved checkpoint must reproduce the live model under the policy (partial ZeRO-3 saves, lost LoRA
    merges)."""
    import torch

    with torch.no_grad():
        saved = float(exported(**probe)["loss"])
    return compare_export(saved, live_loss, live_dtype)
