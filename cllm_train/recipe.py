"""``recipe=cllm``: consistency training (CLLM, Kou et al., 2024) on Jacobi trajectories of the same model.

The ``recipes.finetune`` sequence with ``ConsistencyLM`` under ``CLLMTrainer``: trajectories
(checked against the tokenizer before the weights load) -> examples -> model -> held-out perplexity + Jacobi
tokens per forward (before) -> train -> export (verified against the live model) -> the same measurement
(after) -> ``summary.json``. The exported checkpoint is a plain HF directory; decode it with
``fastdecode.registry.get_decoder("jacobi")``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from cllm_train.config import CLLMConfig
from cllm_train.dataset import build_examples, collate, load_trajectories
from cllm_train.module import ConsistencyLM
from cllm_train.records import model_identity
from cllm_train.trainer import CLLMTrainer
from fastdecode.config import to_dataclass
from fastdecode.data.chat import build_datasets, user_prompt_ids
from fastdecode.decoding.config import DecodeConfig
from fastdecode.jacobi import JacobiOptions
from fastdecode.registry import get_decoder
from fastdecode.runtime.loading import resolve_device
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.tokens import eos_ids, next_token_nll
from fastdecode.tokens import perplexity as token_perplexity
from recipes.common import TrainJob, job_tokenizer
from recipes.finetune import FinetuneRun, Recipe, finetune

log = logging.getLogger(__name__)


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
        ids, labels = (torch.tensor([ex[key]], device=model.device) for key in ("input_ids", "labels"))
        logits = model(input_ids=ids).logits  # [1, T, V]
        one_nll, one_tokens = next_token_nll(logits, labels, head=lambda x: x)
        nll, tokens = nll + one_nll.item(), tokens + one_tokens
    return token_perplexity(nll, tokens)


def measure(model, tokenizer, held_out: list[dict], rcfg: CLLMConfig, block: int) -> dict:
    """Held-out perplexity and greedy Jacobi decoding of held-out prompts (batch 1, like the reference)."""
    r = rcfg.report
    model.eval()
    m = EarlyExitModel(model)
    cfg = DecodeConfig(
        max_new_tokens=r.max_new_tokens,
        jacobi=JacobiOptions(block=block),
        eos_token_id=sorted(eos_ids(model, tokenizer)),
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


class CLLM(Recipe):
    """``ConsistencyLM`` under ``CLLMTrainer`` on trajectory examples (no eval set: held-out conversations feed
    the report); perplexity and Jacobi tokens per forward before and after."""

    trainer_class = CLLMTrainer

    def __init__(self, job: TrainJob) -> None:
        super().__init__(job)
        self.rcfg = to_dataclass(CLLMConfig, job.recipe, "recipe")
        self.seed = job.seed if self.rcfg.seed is None else self.rcfg.seed
        self.manifest: dict = {}  # the rest is set by prepare()
        self.records: list[dict] = []
        self.train: list[dict] = []
        self.held_out: list[dict] = []
        self.block = 0

    def prepare(self) -> None:
        """Trajectories checked against the tokenizer, examples built: all before the weights load."""
        tokenizer = job_tokenizer(self.job)
        self.manifest, self.records = load_trajectories(
            self.rcfg.trajectories, tokenizer, model_identity(self.job.model), self.rcfg.max_records
        )
        self.train = build_examples(self.records, self.rcfg)
        self.held_out = _held_out(self.job, self.rcfg, tokenizer, {r["prompt_id"] for r in self.records})
        self.block = self.rcfg.report.block_size or max(len(r["fixed_point"]) for r in self.records)

    def datasets(self, tokenizer) -> tuple[list[dict], list[dict]]:
        return self.train, self.held_out

    def eval_dataset(self, held_out: list[dict]) -> None:
        return None

    def collator(self, tokenizer, model):
        ar_from_teacher = self.rcfg.ar_target == "fixed_point"
        return functools.partial(collate, pad_id=tokenizer.pad_token_id, ar_from_teacher=ar_from_teacher)

    def module(self, model, args) -> ConsistencyLM:
        return ConsistencyLM(model, self.rcfg, self.seed)

    def trainer_kwargs(self, tokenizer) -> dict:
        return {"draw_base": self.seed}

    def summary(self) -> dict:
        path, model = str(self.rcfg.trajectories), self.manifest["model"]
        return {"trajectories": {"path": path, "records": len(self.records), "model": model}}

    def before_report(self, model, tokenizer, held_out: list[dict]) -> dict | None:
        r = self.rcfg.report
        return measure(model, tokenizer, held_out, self.rcfg, self.block) if r.enabled and r.before else None

    def after_report(self, run: FinetuneRun) -> dict:
        if not self.rcfg.report.enabled:
            return {}
        run.final.to(resolve_device(self.job.model.device))
        after = measure(run.final, run.tokenizer, run.held_out, self.rcfg, self.block)
        log.info("cllm: before %s, after %s", run.before, after)
        return {"report": {"before": run.before, "after": after}}


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Train on ``recipe.trajectories``, export, measure. Returns the checkpoint path, metrics and report."""
    return finetune(job, cfg, CLLM(job)).summary
