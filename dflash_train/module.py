"""``DFlashLM``: the module the Trainer trains, the DFlash drafter beside the frozen target.

Only the drafter is a parameter. The target is held outside the module tree and gives the block's token
embeddings (its own, the mask row included: frozen), the LM head that turns the drafter's hidden states into
logits, and the teacher. Batches are the feature records of ``fastdecode/training/features.py``
(``collate_records``); one forward runs every block of every row under ``block_mask``. Details:
docs/design/methods.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.losses import anchor_positions, block_inputs, block_metrics, dflash_loss, slot_weights
from fastdecode.config import ConfigError
from fastdecode.drafters.dflash.layer import DFlashDraft, block_mask
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training.draws import draw_generator
from fastdecode.training.features import collate_features

EVAL_STREAM = "dflash-eval-anchors"  # the anchors of a batch that brings none (evaluation, the export check)


class TargetHeadError(ConfigError):
    """A target whose LM head cannot serve a DFlash drafter; the message names the problem and the fix."""


def check_target_head(m: EarlyExitModel, hidden_size: int | None = None) -> None:
    """Refuse a target whose config ties its head to its embedding but whose loaded head is another tensor
    (a loader that left it untied, e.g. random: the drafter would learn a head nobody serves), and one whose
    head or token embedding is not ``hidden_size`` wide (the drafter's width; OPT's projections)."""
    embed = m.hf.get_input_embeddings().weight
    head = m.lm_head.weight
    tied = bool(getattr(m.config, "tie_word_embeddings", False))
    same = head is embed or (head.shape == embed.shape and torch.equal(head.detach(), embed.detach()))
    if tied and not same:
        raise TargetHeadError(
            f"the target {type(m.hf).__name__} declares tie_word_embeddings=true but its lm_head is not its "
            "input embedding (left untied when it loaded): load it so the head is the embedding "
            "(model.tie_weights()), or set tie_word_embeddings=false in its config if the head is its own."
        )
    width = hidden_size or m.config.hidden_size
    if m.lm_head.in_features != width or embed.shape[-1] != width:
        raise TargetHeadError(
            f"the target's embedding ({embed.shape[-1]}) and head input ({m.lm_head.in_features}) must both be "
            f"its hidden size {width} for a DFlash drafter: choose a target without input/output projections."
        )


def collate_records(records: list[dict[str, torch.Tensor]], feature_ids: list[int]) -> dict[str, Any]:
    """Cached records -> ``features [B, W, k * Ht]`` (the feature layers concatenated in id order, float32,
    zeros past a row), ``input_ids [B, W + 1]`` (right-padded with 0; the slot after the last scored position
    holds its token), ``response [B, W + 1]`` (a scored token: the next token of a scored position),
    ``label_index [B, W + 1]`` (where ``response``, the row of ``final`` that predicts it, else -1) and,
    when the records carry it, ``final [M, H]`` (the target's head input at each scored position)."""
    out = collate_features(records, feature_ids)
    rows, cols = out["rows"], out["cols"]
    batch, width = out["position_ids"].shape
    ids = torch.zeros(batch, width + 1, dtype=torch.long)
    for row, r in enumerate(records):
        ids[row, : len(r["input_ids"])] = r["input_ids"].long()
    ids[rows, cols + 1] = out["targets"]
    response = torch.zeros(batch, width + 1, dtype=torch.bool)
    response[rows, cols + 1] = True
    index = torch.full((batch, width + 1), -1, dtype=torch.long)
    index[rows, cols + 1] = torch.arange(len(rows))
    batch_out = {
        "input_ids": ids,
        "features": torch.cat([out["hidden"][str(e)] for e in feature_ids], dim=-1),
        "response": response,
        "label_index": index,
    }
    return batch_out | ({"final": out["final"]} if "final" in out else {})


class DFlashLM(nn.Module):
    """The drafter trained against the frozen target (module docstring).

    Args:
        m: the frozen target (embedding and LM head; never trained nor saved).
        draft: the ``DFlashDraft``.
        loss: ``{"kind", "gamma", "num_anchors", "seed"}``: ``dflash_loss``'s kind, the slot decay, the
            blocks per row and the seed of the anchors a batch without its own draws (``EVAL_STREAM``).
        feature_scale: ``[k * Ht]``: the drafter reads ``features / feature_scale`` (``scaling.py``; folded
            into ``fc`` at export); None: the raw features (an exported drafter).
    """

    def __init__(
        self,
        m: EarlyExitModel,
        draft: DFlashDraft,
        loss: dict[str, Any],
        feature_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        check_target_head(m, draft.config.hidden_size)
        self.draft = draft
        self._frozen = (m,)  # a tuple: not a submodule, so neither trained nor saved
        self.config = m.hf.config  # the target's: DeepSpeed sizes its buckets from ``hidden_size``
        self.loss_cfg = dict(loss)
        self.block = draft.config.block_size
        self.feature_scale = None if feature_scale is None else feature_scale.float().cpu()
        self.last_metrics: dict[str, torch.Tensor] = {}

    @property
    def m(self) -> EarlyExitModel:
        return self._frozen[0]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's frozen LM head on ``hidden [..., H]`` -> float32 logits ``[..., V]``."""
        lm = self.m.lm_head
        bias = None if lm.bias is None else lm.bias.detach().float()
        return F.linear(hidden.float(), lm.weight.detach().float(), bias)

    def draw(self, response: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The anchors of a batch that brings none: seeded, the same on every call (the export check compares
        two forwards)."""
        gens = [draw_generator(EVAL_STREAM, self.loss_cfg["seed"], row) for row in range(response.shape[0])]
        return anchor_positions(response, self.loss_cfg["num_anchors"], gens)

    def hidden_states(
        self, input_ids: torch.Tensor, features: torch.Tensor, blocks: dict[str, torch.Tensor], anchors, keep
    ) -> torch.Tensor:
        """The drafter over every block of every row in one forward -> final-normed ``[B, Q, H]``: context
        ``features [B, S, k * Ht]`` at positions ``0 .. S-1``, block ``n`` seeing those ``< anchors[:, n]``."""
        dtype = next(self.draft.parameters()).dtype
        with torch.no_grad():
            noise = self.m.token_embed(blocks["tokens"]).to(dtype)
        if self.feature_scale is not None:
            features = features / self.feature_scale.to(features.device)
        batch, context = features.shape[:2]
        ctx_positions = torch.arange(context, device=features.device).expand(batch, -1)
        kv = self.draft.context_kv(features.to(dtype), ctx_positions)
        mask = block_mask(anchors, keep, context, self.block)
        return self.draft(noise, blocks["positions"], kv, mask)

    @torch.no_grad()
    def teacher(
        self, final: torch.Tensor, label_index: torch.Tensor, blocks, valid
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's log-probabilities ``[U, V]`` of the distinct label positions of the scored slots
        (``final``'s row that predicts the token there), and each scored slot's row among them ``[M]``."""
        rows = torch.gather(label_index, 1, blocks["label_pos"])[valid]
        if bool((rows < 0).any()):
            raise ValueError("a scored slot has no teacher row: the batch's label_index does not cover it")
        unique, slot_rows = torch.unique(rows, return_inverse=True)
        return torch.log_softmax(self.head(final[unique]), dim=-1), slot_rows

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        response: torch.Tensor,
        label_index: torch.Tensor,
        *,
        final: torch.Tensor | None = None,
        anchors: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
        weight_items: torch.Tensor | None = None,
        **unused: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The weighted DFlash loss of a collated batch, divided by its total slot weight, or by
        ``weight_items`` (the whole accumulated batch's, ``losses.anchor_weight_sum``). ``anchors``/``keep``
        ``[B, N]``: the blocks (the trainer draws them per step; none: ``draw``)."""
        cfg = self.loss_cfg
        if anchors is None or keep is None:
            anchors, keep = self.draw(response)
        mask_id = self.draft.config.mask_token_id
        blocks = block_inputs(input_ids, anchors, keep, response, block=self.block, mask_token_id=mask_id)
        hidden = self.hidden_states(input_ids, features, blocks, anchors, keep)
        valid = blocks["valid"]
        logits = self.head(hidden[valid])  # [M, V]: the head on the scored slots only
        target, target_rows = None, None
        if cfg["kind"] != "ce":
            if final is None:
                raise ValueError("loss kind kl needs the records' final hidden states (collate_records)")
            target, target_rows = self.teacher(final, label_index, blocks, valid)
        weights = slot_weights(valid, self.block, cfg["gamma"])[valid]
        labels = blocks["labels"][valid]
        loss_sum, weight_sum = dflash_loss(
            logits, weights, kind=cfg["kind"], labels=labels, target_logp=target, target_rows=target_rows
        )
        drafts = torch.full_like(blocks["labels"], -1)
        drafts[valid] = logits.detach().argmax(-1)
        self.last_metrics = block_metrics(drafts, blocks["labels"], valid, self.block)
        denominator = weight_items if weight_items is not None else weight_sum.clamp(min=1e-6)
        return {"loss": loss_sum / denominator}
