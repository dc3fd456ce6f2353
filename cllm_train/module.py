"""``ConsistencyLM``: the module the Trainer trains; its forward computes the CLLM loss.

It is a wrapper module (``fastdecode.training.wrapped_lm``) so that DDP and DeepSpeed see the loss inside the
forward. Per micro-batch it makes one forward with gradient (student and AR rows stacked) and at most one
without (the remaining teacher rows); which ones depends on the config only, so every rank makes the same
calls. The LM head runs on the scored positions only. Details: docs/design/methods.md.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from cllm_train.config import CLLMConfig
from cllm_train.dataset import draw_states, state_uniforms
from cllm_train.losses import Term, ar_loss, consistency_loss, consistency_positions
from fastdecode.tokens import IGNORE_INDEX, next_token_targets
from fastdecode.training.wrapped_lm import WrappedLM, causal_mask_from_padding

__all__ = ["ConsistencyLM"]

Rows = tuple[torch.Tensor, torch.Tensor]  # (ids [B, T], 0/1 mask [B, T])


class ConsistencyLM(WrappedLM):
    """Wraps a HF causal LM; ``forward(**collate(...), picks=...)`` returns the CLLM loss.

    Args:
        model: the HF model (possibly a peft model: its base model's layers are used, LoRA included).
        cfg: the recipe config (which consistency loss, AR target and weight, label smoothing).
        seed: the state draw when a batch comes without ``picks`` (evaluation): fixed, so repeatable.
    """

    def __init__(self, model: PreTrainedModel, cfg: CLLMConfig, seed: int = 0) -> None:
        super().__init__(model)
        self.cfg, self.seed = cfg, seed

    def hidden_states(self, rows: list[Rows]) -> list[torch.Tensor]:
        """Final residual streams of several row groups in one stacked forward: ``[B_i, T_i, H]`` each.

        Groups are right-padded to a common width; positions count real tokens from 0 in every row, so a left-
        padded prefix starts at position 0 as it did when the trajectory was collected.
        """
        m = self.m
        width = max(ids.shape[1] for ids, _ in rows)
        ids = torch.cat([nn.functional.pad(i, (0, width - i.shape[1])) for i, _ in rows])  # [R, W]
        valid = torch.cat([nn.functional.pad(v, (0, width - v.shape[1])) for _, v in rows]).bool()
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        mask = causal_mask_from_padding(valid, m.dtype)  # None without padding: SDPA's causal kernel
        hidden = m.run_layers(m.embed(ids, positions), 0, m.num_layers, positions, mask)
        return [
            h[:, : i.shape[1]]
            for h, (i, _) in zip(hidden.split([i.shape[0] for i, _ in rows]), rows, strict=True)
        ]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        states: torch.Tensor,
        first_mismatch: torch.Tensor,
        block_len: torch.Tensor,
        labels: torch.Tensor,
        picks: torch.Tensor | None = None,
        ar_input_ids: torch.Tensor | None = None,
        ar_attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        consistency_items: int | torch.Tensor | None = None,
        **_: object,
    ) -> dict:
        """CLLM loss of one batch of ``cllm_train.dataset.collate`` (see there for the shapes).

        ``picks [B]``: the student state per row (-1: none, AR loss only); None draws with ``self.seed``.
        ``num_items_in_batch`` / ``consistency_items``: AR target tokens / consistency positions of the whole
        accumulated batch (None: this batch's own counts).
        """
        cfg = self.cfg
        if picks is None:
            picks = draw_states(
                first_mismatch, block_len, state_uniforms(self.seed, 0, 0, range(len(block_len)))
            )
        batch, width = input_ids.shape
        prefix_w = width - states.shape[2]
        rows = torch.arange(batch, device=input_ids.device)
        pick = picks.clamp(min=0)
        mismatch = torch.where(picks >= 0, first_mismatch[rows, pick], block_len)
        scored = consistency_positions(mismatch, block_len, prefix_w, width)  # K: [B, W]
        student = torch.cat([input_ids[:, :prefix_w], states[rows, pick]], 1)  # x ⊕ y(i)
        fused = cfg.uses_ar and cfg.ar_target == "fixed_point"  # AR rows == global teacher rows
        grad_rows = [(student, attention_mask)]
        if cfg.uses_ar:
            grad_rows.append((input_ids, attention_mask) if fused else (ar_input_ids, ar_attention_mask))
        hidden = self.hidden_states(grad_rows)
        teachers = self._teachers(
            input_ids, attention_mask, states, pick, prefix_w, hidden[1] if fused else None
        )
        loss, out = self._consistency(hidden[0], teachers, scored, consistency_items)
        if cfg.uses_ar:
            targets = next_token_targets(labels)
            keep = targets != IGNORE_INDEX
            logits = self.m.exit_logits(hidden[1][keep])  # [N_AR, V]: the scored positions only
            ar = ar_loss(logits, targets[keep], cfg.label_smoothing, num_items_in_batch)
            loss = loss + cfg.ar_weight * ar.loss
            out["loss_ar"] = ar.mean
        return {"loss": loss} | out

    def _consistency(
        self,
        student: torch.Tensor,
        teachers: dict[str, torch.Tensor],
        scored: torch.Tensor,
        num_items: int | torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sum of the consistency terms over the positions ``scored [B, W]`` of ``student [B, W, H]`` and
        each teacher ``[B, W, H]``; with the per-token means to log."""
        terms: dict[str, Term] = {}
        student_logits = self.m.exit_logits(student[scored])  # [N_K, V]
        for kind, teacher in teachers.items():
            with torch.no_grad():
                teacher_logits = self.m.exit_logits(teacher[scored])  # [N_K, V]
            terms[kind] = consistency_loss(student_logits, teacher_logits, num_items=num_items)
        out = {"loss_consistency": sum(t.mean for t in terms.values())}
        if len(terms) > 1:
            out |= {f"loss_{kind}": t.mean for kind, t in terms.items()}
        return sum(t.loss for t in terms.values()), out

    def _teachers(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        states: torch.Tensor,
        pick: torch.Tensor,
        prefix_w: int,
        fused: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """Teacher hidden states ``{"global": [B, W, H], "local": [B, W, H]}``, no gradient (one forward)."""
        rows: list[Rows] = []
        if self.cfg.uses_global and fused is None:
            rows.append((input_ids, attention_mask))  # x ⊕ y*
        if self.cfg.uses_local:
            after = states[
                torch.arange(len(pick), device=pick.device), (pick + 1).clamp(max=states.shape[1] - 1)
            ]
            rows.append((torch.cat([input_ids[:, :prefix_w], after], 1), attention_mask))  # x ⊕ y(i+1)
        with torch.no_grad():
            hidden = self.hidden_states(rows) if rows else []
        out = {}
        if self.cfg.uses_global:
            out["global"] = fused.detach() if fused is not None else hidden[0]
        if self.cfg.uses_local:
            out["local"] = hidden[-1]
        return out
