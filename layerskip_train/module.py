"""``EarlyExitLM``: the module the Trainer trains; its forward computes the LayerSkip loss.

Why a wrapper module (``fastdecode.training.wrapped_lm``): under DDP and DeepSpeed the loss must be computed inside
the forward of the wrapped module, so layer dropout and the early-exit loss live in ``forward``.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from fastdecode.training.draws import draw_generator
from fastdecode.training.wrapped_lm import WrappedLM, causal_mask_from_padding
from layerskip_train.config import LayerSkipConfig
from layerskip_train.early_exit_loss import active_exits, early_exit_loss, scale_weights
from layerskip_train.layer_dropout import drop_mask, dropout_rates, parse_layers, run_with_layer_dropout

__all__ = ["EarlyExitLM"]

TOKEN_STREAM = "exit-tokens"  # the draw stream of the exit-token subsets (token_fraction < 1)


class EarlyExitLM(WrappedLM):
    """Wraps a HF causal LM; ``forward(input_ids, labels, ..., step)`` returns the LayerSkip loss.

    Args:
        model: the HF model (possibly a peft model: its base model's layers are used).
        cfg: the recipe config (exits, curriculum, scales, layer dropout).
        seed: run seed; drops are drawn from (seed, step, micro_step, rank), so a resumed run draws the same.
        total_steps: for the gradual curriculum and the exp time scale.
        rank: process rank, so ranks draw different drops.
        exit_chunks: a fixed number of head+CE chunks per exit (ZeRO-3 needs the same call sequence on
            every rank); None: chunks of ``early_exit_loss.chunk_size`` tokens.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cfg: LayerSkipConfig,
        *,
        seed: int,
        total_steps: int,
        rank: int = 0,
        exit_chunks: int | None = None,
    ) -> None:
        super().__init__(model)
        self.cfg = cfg
        self.seed, self.total_steps, self.rank = seed, max(total_steps, 1), rank
        self.exit_chunks = exit_chunks
        num_layers = self.m.num_layers
        self.candidate_exits = parse_layers(cfg.early_exit_loss.layers, num_layers)
        self.drop_layers = parse_layers(cfg.layer_dropout.layers, num_layers)

    def exits_at(self, step: int) -> list[int]:
        """Active exits (0-based blocks, logged as ``loss/exit_{l + 1}``) at optimiser step ``step``.

        A pure function of the step (``early_exit_loss.active_exits``), so resuming repeats it exactly.
        """
        ee = self.cfg.early_exit_loss
        return active_exits(
            ee.curriculum, self.candidate_exits, self.m.num_layers, step, self.total_steps, stride=ee.stride
        )

    def drops_at(self, step: int, micro_step: int, batch: int) -> torch.Tensor | None:
        """``[L, B]`` bool drop mask for this (step, micro-step, rank), or None without dropout."""
        ld = self.cfg.layer_dropout
        if ld.prob == 0 or not self.training:
            return None
        rates = dropout_rates(
            ld.prob,
            self.m.num_layers,
            self.drop_layers,
            scale=ld.layers_scale,
            time_scale=ld.time_scale,
            step=step,
            total_steps=self.total_steps,
        )
        return drop_mask(rates, batch, seed=self.seed, step=step, micro_step=micro_step, rank=self.rank)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        step: int = 0,
        micro_step: int = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        **_: object,
    ) -> dict:
        """Loss of ``input_ids/labels [B, T]``; eval mode: the final exit only (plain LM loss)."""
        m, ee = self.m, self.cfg.early_exit_loss
        batch, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, -1)
        mask = causal_mask_from_padding(attention_mask, m.dtype)
        exits = self.exits_at(step) if self.training else [m.num_layers - 1]
        hidden = m.embed(input_ids, position_ids)
        hiddens = run_with_layer_dropout(
            m,
            hidden,
            position_ids,
            mask,
            drops=self.drops_at(step, micro_step, batch),
            exit_layers=exits,
            touch_skipped=self.cfg.touch_skipped_layers and self.training,
        )
        weights = scale_weights(ee.scale_fn, exits, m.num_layers, ee.scale)
        distill = ee.self_distill() if self.training else None
        out = early_exit_loss(
            m,
            hiddens,
            labels,
            weights,
            num_items=num_items_in_batch,
            chunk_size=ee.chunk_size,
            distill=distill,
            num_chunks=self.exit_chunks,
            token_fraction=ee.token_fraction if self.training else 1.0,
            generator=draw_generator(TOKEN_STREAM, self.seed, step, micro_step, self.rank),
        )
        return {"loss": out.loss, "exit_ce": out.ce, "exit_kl": out.kl}
