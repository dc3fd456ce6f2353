"""What every training recipe shares: the typed job config, TrainingArguments, resume, LoRA, the DeepSpeed
batch check and the checkpoint export. The step sequence that uses them is ``recipes.finetune``."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

from fastdecode.config import CONFIG_DIR, ConfigError, ModelConfig, to_dataclass
from fastdecode.data.config import DataConfig
from fastdecode.files.checkpoint_info import checkpoint_model
from fastdecode.files.distributed import is_main_process, world_size
from recipes.trainer_args import check_trainer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DeepSpeedConfig:
    """``configs/deepspeed/<name>.yaml``: a DeepSpeed JSON (relative to configs/deepspeed/) or null."""

    config_file: str | None = None

    def path(self) -> Path | None:
        if self.config_file is None:
            return None
        path = Path(self.config_file)
        if not path.is_absolute() and not path.exists():
            path = CONFIG_DIR / "deepspeed" / path
        if not path.is_file():
            raise ConfigError(f"deepspeed.config_file '{self.config_file}' not found (looked at {path}).")
        return path


@dataclasses.dataclass
class TrainJob:
    """The composed ``configs/train.yaml``, typed. ``recipe`` is converted by the recipe itself."""

    recipe: dict
    model: ModelConfig
    data: DataConfig
    trainer: dict
    deepspeed: DeepSpeedConfig = dataclasses.field(default_factory=DeepSpeedConfig)
    peft: PeftConfig = dataclasses.field(default_factory=lambda: PeftConfig())
    seed: int = 0
    run_name: str = "run"
    output_dir: str = "outputs/run"
    resume_from_checkpoint: str | None = None
    checkpoint: str | None = None  # a trained checkpoint to train from (fastdecode.files.checkpoint_info)
    experiment: dict | None = None  # an experiment config may leave notes here (name, budget, result)


def load_job(cfg: Any) -> TrainJob:
    """Convert the composed config into a ``TrainJob``; unknown or misspelt keys fail, naming the key."""
    job = to_dataclass(TrainJob, cfg, "")
    if "name" not in job.recipe:
        raise ConfigError("recipe.name is missing: pick a recipe with recipe=NAME.")
    job.model = checkpoint_model(job.model, job.checkpoint)  # a contradicting model= fails here
    job.trainer = check_trainer(job.trainer)  # keys and values, typed before anything loads
    return job


def job_tokenizer(job: TrainJob):
    """The model's tokenizer without its weights, for checks before they load (a packaged GGUF is converted
    once, then cached)."""
    from fastdecode.files.assets import model_load_path
    from fastdecode.runtime.loading import load_tokenizer

    path = None if job.model.source == "random" or job.model.tokenizer else model_load_path(job.model)
    return load_tokenizer(job.model, path)


def training_arguments(job: TrainJob, **overrides: Any):
    """``transformers.TrainingArguments`` from the trainer group plus the job-level fields."""
    from transformers import TrainingArguments

    ds = job.deepspeed.path()
    kwargs = dict(job.trainer) | {
        "output_dir": job.output_dir,
        "seed": job.seed,
        "run_name": job.run_name,
        "deepspeed": str(ds) if ds else None,
    }
    kwargs.update(overrides)
    _offline_wandb(kwargs.get("report_to"))
    return TrainingArguments(**kwargs)


def _offline_wandb(report_to: str | list[str] | None) -> None:
    """wandb without credentials (or without network) logs offline instead of prompting or retrying."""
    import os

    targets = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if "wandb" not in targets and "all" not in targets or "WANDB_MODE" in os.environ:
        return
    netrc = Path.home() / ".netrc"
    has_key = "WANDB_API_KEY" in os.environ or (netrc.is_file() and "api.wandb.ai" in netrc.read_text())
    if not has_key or os.environ.get("HF_HUB_OFFLINE") == "1":
        os.environ["WANDB_MODE"] = "offline"
        log.info("wandb: no API key or offline machine, logging offline (wandb sync later)")


@dataclasses.dataclass
class PeftConfig:
    """``configs/peft/<name>.yaml``: LoRA through peft (merged into the weights on save by default)."""

    method: str = "none"  # none | lora
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"
    merge_on_save: bool = True

    def __post_init__(self) -> None:
        if self.method not in ("none", "lora"):
            raise ConfigError(f"peft.method must be none or lora, got '{self.method}'.")


def apply_peft(model, cfg: PeftConfig, gradient_checkpointing: bool = False):
    """Wrap ``model`` with LoRA (``peft.method=lora``); the model unchanged otherwise."""
    if cfg.method == "none":
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    if gradient_checkpointing:  # LoRA + checkpointing: frozen inputs need grads, or nothing updates
        model.enable_input_require_grads()
    return get_peft_model(model, lora)


def check_deepspeed_batch(job: TrainJob) -> None:
    """Explicit DeepSpeed batch sizes must equal micro x grad_accum x world size (checked before loading)."""
    path = job.deepspeed.path()
    if path is None:
        return
    import json

    ds = json.loads(path.read_text())
    micro = ds.get("train_micro_batch_size_per_gpu", "auto")
    accum = ds.get("gradient_accumulation_steps", "auto")
    total = ds.get("train_batch_size", "auto")
    micro = job.trainer.get("per_device_train_batch_size", 8) if micro == "auto" else micro
    accum = job.trainer.get("gradient_accumulation_steps", 1) if accum == "auto" else accum
    world = world_size()
    if total != "auto" and total != micro * accum * world:
        raise ConfigError(
            f"DeepSpeed config {path.name}: train_batch_size={total} but micro batch {micro} x gradient "
            f"accumulation {accum} x world size {world} = {micro * accum * world}. "
            'Set the DeepSpeed fields to "auto" (the Trainer fills them) or make them agree.'
        )
    for key, mine in (
        ("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
    ):
        if ds.get(key, "auto") != "auto" and mine in job.trainer and ds[key] != job.trainer[mine]:
            raise ConfigError(
                f"DeepSpeed config {path.name}: {key}={ds[key]} disagrees with trainer.{mine}="
                f'{job.trainer[mine]}; use "auto" in the DeepSpeed config.'
            )


def export_checkpoint(trainer, hf_model, tokenizer, peft: PeftConfig, out_dir: str | Path):
    """Save the trained weights as a plain HF directory that ``from_pretrained`` loads; return that model.

    ``out_dir`` is the staging directory of ``fastdecode.files.io.atomic_directory`` in every recipe, so that
    ``final/`` appears whole (weights, tokenizer, the recipe's additions, a file manifest) or not at all.

    Works the same for single process, DDP and ZeRO-2/3: the full state dict is gathered (ZeRO-3 partitions
    are all-gathered; every rank must call this), loaded on rank 0 into a fresh model of the same class
    (LoRA merged unless ``peft.merge_on_save`` is false), and saved. The trained module is a ``WrappedLM``
    around ``hf_model`` or ``hf_model`` itself (``recipe=sft``). Returns the fresh model on rank 0, None
    elsewhere.
    """
    from fastdecode.training.wrapped_lm import WrappedLM

    module = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    state = full_state_dict(module)
    if not is_main_process():
        return None
    if isinstance(module, WrappedLM):  # the wrapper holds the HF model as ``model``
        state = {k.removeprefix("model."): v for k, v in state.items()}
    fresh = _fresh_like(hf_model, peft)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    missing = [k for k in missing if "lm_head" not in k]  # tied head: saved once as the embedding
    if missing or unexpected:
        raise RuntimeError(f"checkpoint export: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if peft.method != "none" and peft.merge_on_save:
        fresh = fresh.merge_and_unload()
    fresh.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return fresh


def full_state_dict(module) -> dict:
    """The module's full state dict on the CPU, ZeRO-3 partitions gathered (every rank must call this).

    Built from ``module.state_dict()`` (so a wrapper's own rules, such as saving tied weights once, apply),
    inside DeepSpeed's ``GatheredParameters`` when parameters are partitioned.
    """
    params = list(module.parameters())
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3: parameters are partitioned across ranks
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _fresh_like(hf_model, peft: PeftConfig):
    """An untrained model with ``hf_model``'s architecture (and LoRA layout), on the CPU in fp32."""
    base = hf_model.get_base_model() if hasattr(hf_model, "get_base_model") else hf_model
    config = copy.deepcopy(base.config)
    # The class itself, not from_config: under ZeRO-3 from_config would partition the new model again.
    fresh = type(base)(config).float()
    fresh.generation_config = copy.deepcopy(base.generation_config)
    return apply_peft(fresh, peft) if peft.method != "none" else fresh


def probe_loss(trainer, probe: dict) -> float:
    """The live (possibly wrapped and sharded) training module's loss on a fixed probe batch, in eval mode.

    Every rank must call this: under ZeRO-3 the forward gathers the partitions.
    """
    import torch

    model = trainer.model_wrapped
    model.eval()
    with torch.no_grad():
        loss = model(**to_device(probe, trainer.args.device))["loss"]
    return float(loss)


def to_device(batch: dict, device) -> dict:
    """A collated batch on ``device``; nested dicts of tensors too (the exit adapters' ``hidden[E]``)."""
    return {k: to_device(v, device) if isinstance(v, dict) else v.to(device) for k, v in batch.items()}


def forward_reduction(config, positions: int) -> int:
    """The summed lengths of the sums one forward of a decoder with HF ``config`` chains over ``positions``
    (the ``n`` of Higham's dot-product error bound, docs/design/recipes.md): per layer the two norms, q and k,
    q.k, the softmax and its weighted sum, the output projection, the MLP's two inputs and its output; then
    the final norm and the head."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    inner = getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None) or 4 * hidden
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layer = 6 * hidden + head_dim + 2 * positions + heads * head_dim + inner
    return config.num_hidden_layers * layer + 2 * hidden


def export_tolerance(live_dtype, config, tokens: int) -> float:
    """The relative gap between the live model's probe loss on ``tokens`` positions and the fp32 export's that
    rounding explains (docs/design/recipes.md): ``n * u`` of fp32 for the sums (``forward_reduction``, the
    log-softmax, the mean; half-precision matmuls accumulate in fp32), plus, for a bf16/fp16 live model, its
    unit roundoff times the square root of the tensors it rounds (16 a layer, 4 after them)."""
    import math

    import torch

    n = forward_reduction(config, tokens) + config.vocab_size + tokens
    tol = n * torch.finfo(torch.float32).eps / 2
    if torch.finfo(live_dtype).eps > torch.finfo(torch.float32).eps:
        tol += math.sqrt(16 * config.num_hidden_layers + 4) * torch.finfo(live_dtype).eps / 2
    return tol


def compare_export(saved_loss: float, live_loss: float, tolerance: float) -> dict:
    """Raise unless the exported checkpoint's probe loss matches the live model's within ``tolerance``
    relative to ``max(1, |live_loss|)`` (``export_tolerance``): catches partial ZeRO-3 saves and lost LoRA
    merges, never a kernel's rounding."""
    diff = abs(saved_loss - live_loss)
    allowed = tolerance * max(1.0, abs(live_loss))
    if diff > allowed:
        raise RuntimeError(
            f"exported checkpoint disagrees with the trained model: loss {saved_loss} vs {live_loss} "
            f"(|difference| {diff:.3g} > {allowed:.3g}, what rounding explains)"
        )
    return {"live_loss": live_loss, "saved_loss": saved_loss, "abs_diff": diff, "tolerance": allowed}
