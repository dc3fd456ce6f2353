"""What the training packages share: ``fastdecode.tokens`` (label shift, NLL, perplexity) and
``fastdecode.training`` (component-loss logs, seeded draws, the padding -> causal mask)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainingArguments

from fastdecode.runtime.cache import attention_mask
from fastdecode.tokens import IGNORE_INDEX, next_token_nll, next_token_targets, perplexity
from fastdecode.training.draws import draw_generator, row_uniforms
from fastdecode.training.trainer_logs import ComponentLogsMixin, RunningMeans
from fastdecode.training.wrapped_lm import causal_mask_from_padding


def test_next_token_targets_shift_labels_left_and_ignore_the_last_column():
    labels = torch.tensor([[IGNORE_INDEX, 5, 6, 7], [IGNORE_INDEX, IGNORE_INDEX, 8, IGNORE_INDEX]])
    assert next_token_targets(labels).tolist() == [[5, 6, 7, -100], [-100, 8, -100, -100]]
    assert next_token_targets(torch.tensor([1, 2])).tolist() == [2, -100]  # one row, no batch dimension


def test_next_token_nll_equals_the_hf_loss_and_scores_labelled_positions_only():
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, 5], [IGNORE_INDEX, 1, 2, IGNORE_INDEX, 7]])
    seen: list[int] = []

    def head(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return x

    total, count = next_token_nll(logits, labels, head)
    ref = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    assert count == 6 and seen == [6] and torch.allclose(total, ref)
    assert perplexity(total.item(), count) == pytest.approx(math.exp(ref.item() / 6))
    assert perplexity(0.0, 0) is None and perplexity(1e9, 1) == math.exp(50.0)  # nothing scored / capped


def test_draws_are_pure_functions_of_stream_and_key():
    a = torch.rand(4, generator=draw_generator("s", 1, 2, 3))
    assert torch.equal(a, torch.rand(4, generator=draw_generator("s", 1, 2, 3)))
    assert not torch.equal(a, torch.rand(4, generator=draw_generator("t", 1, 2, 3)))  # streams apart
    assert not torch.equal(a, torch.rand(4, generator=draw_generator("s", 1, 2, 4)))
    u = row_uniforms((0, 5, 1), range(4))
    assert u.dtype == torch.float64 and ((u >= 0) & (u < 1)).all()
    assert torch.equal(u[2:], row_uniforms((0, 5, 1), range(2, 4)))  # per row, whatever the split
    assert not torch.equal(u, row_uniforms((0, 5, 2), range(4)))
    assert row_uniforms((0, 5, 1), range(0)).shape == (0,)


def test_causal_mask_from_padding():
    assert causal_mask_from_padding(None, torch.float32) is None
    assert causal_mask_from_padding(torch.ones(2, 5, dtype=torch.long), torch.float32) is None  # SDPA causal
    packed = torch.zeros(2, 1, 5, 5)
    assert causal_mask_from_padding(packed, torch.float32) is packed
    padded = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    mask = causal_mask_from_padding(padded, torch.bfloat16)
    assert torch.equal(mask, attention_mask(padded.bool(), 0, 4, torch.bfloat16))
    assert mask.shape == (2, 1, 4, 4) and mask[1, 0, 0, 1] == torch.finfo(torch.bfloat16).min  # causal


class _Parts(nn.Module):
    """A linear model whose loss has two logged parts."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, **_: object) -> dict:
        err = (self.w(x).squeeze(-1) - labels) ** 2
        return {"loss": err.mean(), "first": err[0].detach(), "double": 2 * err.mean().detach()}


class _PartsTrainer(ComponentLogsMixin, Trainer):
    def loss_components(self, outputs):
        return {"loss/first": outputs["first"], "loss/double": outputs["double"]}


def test_component_losses_are_logged_in_training_and_in_evaluation(tmp_path):
    data = [{"x": torch.full((3,), float(i)), "labels": torch.tensor(float(i % 3))} for i in range(8)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
    )
    trainer = _PartsTrainer(model=_Parts(), args=args, train_dataset=data, eval_dataset=data)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all({"loss/first", "loss/double"} <= set(h) for h in logs)
    metrics = trainer.evaluate()
    assert {"eval_loss/first", "eval_loss/double"} <= set(metrics)  # the means over the eval batches
    assert metrics["eval_loss/double"] == pytest.approx(2 * metrics["eval_loss"], abs=1e-4)
    assert "loss/first" not in metrics  # evaluation never feeds the training means
    assert trainer.state.log_history[-1]["eval_loss/first"] == metrics["eval_loss/first"]


def test_component_means_come_out_by_exit_whatever_order_the_curriculum_added_them():
    means = RunningMeans()
    means.add({"loss/exit_12": 1.0, "loss/exit_3": 1.0, "kl/exit_3": 1.0, "loss/exit_30": 1.0})
    means.add({"loss/exit_4": 2.0, "kl/exit_4": 2.0, "loss/exit_30": 3.0})
    out = means.pop()
    assert list(out) == [
        "loss/exit_3",
        "loss/exit_4",
        "loss/exit_12",
        "loss/exit_30",
        "kl/exit_3",
        "kl/exit_4",
    ]
    assert out["loss/exit_30"] == 2.0 and means.pop() == {}
