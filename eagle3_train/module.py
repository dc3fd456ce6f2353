"""``Eagle3LM``: the module the Trainer trains, the EAGLE-3 head beside the frozen target.

Only the head is a parameter. The target is held outside the module tree and gives the token embeddings and
the teacher. Batches are the feature records of ``fastdecode/training/features.py`` (``collate_records``),
or, in ``online`` mode, computed per batch by the target (``collate_examples``), laid out as
``eagle3_train.losses.ttt_loss`` reads them. Details: docs/design/methods.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from eagle3_train.losses import ttt_loss
from fastdecode.data.chat import IGNORE_INDEX
from fastdecode.drafters.eagle3.model import Eagle3Head
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.training.feature_records import batch_features
from fastdecode.training.features import collate_features


def collate_records(records: list[dict[str, torch.Tensor]], exits: list[int]) -> dict[str, Any]:
    """Cached records -> ``collate_features``' batch (``hidden``, ``rows``/``cols`` of the scored positions,
    ``teacher``, ``final``, ...) plus ``input_ids [B, T + 1]`` (right-padded with 0; the slot after each
    scored position holds its next token, ``targets``, so the last one is scored too)."""
    out = collate_features(records, exits)
    ids = torch.zeros(len(records), out["position_ids"].shape[1] + 1, dtype=torch.long)
    for row, r in enumerate(records):
        ids[row, : len(r["input_ids"])] = r["input_ids"].long()
    ids[out["rows"], out["cols"] + 1] = out["targets"]
    out.pop("position_ids")
    return out | {"input_ids": ids}


def collate_examples(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Tokenized conversations (online mode) -> ``input_ids``, ``labels [B, T]`` (right-padded: 0 and
    ``IGNORE_INDEX``) and ``lengths [B]``; the module computes their features."""
    lengths = [len(ex["input_ids"]) for ex in examples]
    ids = torch.zeros(len(examples), max(lengths), dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, ex in enumerate(examples):
        ids[row, : lengths[row]] = torch.tensor(ex["input_ids"])
        labels[row, : lengths[row]] = torch.tensor(ex["labels"])
    return {"input_ids": ids, "labels": labels, "lengths": torch.tensor(lengths)}


class Eagle3LM(nn.Module):
    """The head trained with the TTT loss against the frozen target.

    Args:
        m: the frozen target (embedding and LM head; never trained nor saved).
        head: the ``Eagle3Head`` (its draft vocabulary set).
        aux: the feature layers, in the order the head concatenates them.
        loss: ``{"steps", "decay", "kind", "prev_correct"}`` of ``ttt_loss``.
    """

    def __init__(self, m: EarlyExitModel, head: Eagle3Head, aux: list[int], loss: dict[str, Any]) -> None:
        super().__init__()
        self.head = head
        self._frozen = (m,)  # a tuple: not a submodule, so neither trained nor saved
        self.config = m.hf.config  # the target's: DeepSpeed sizes its buckets from ``hidden_size``
        self.aux, self.loss_cfg = list(aux), dict(loss)
        rows = head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=head.d2t.device))
        weight = m.lm_head.weight.detach()
        bias = None if m.lm_head.bias is None else m.lm_head.bias.detach()
        self.register_buffer("teacher_weight", weight[rows.to(weight.device)], persistent=False)
        self.register_buffer(
            "teacher_bias", None if bias is None else bias[rows.to(weight.device)], persistent=False
        )
        self.last_metrics: dict[str, torch.Tensor] = {}

    @property
    def m(self) -> EarlyExitModel:
        return self._frozen[0]

    @torch.no_grad()
    def ttt_batch(
        self, input_ids: torch.Tensor, hidden: dict[str, torch.Tensor], rows, cols, *, teacher, final
    ) -> dict[str, torch.Tensor]:
        """The collated records -> ``ttt_loss``'s batch: embeddings, concatenated features, the teacher's
        draft-vocabulary log-probabilities and argmax draft id at each scored position, the loss mask."""
        batch, width = input_ids.shape
        features = torch.cat([hidden[str(a)] for a in self.aux], dim=-1)
        features = nn.functional.pad(features, (0, 0, 0, width - features.shape[1]))
        positions = torch.arange(width, device=input_ids.device).expand(batch, -1)
        logits = nn.functional.linear(final.float(), self.teacher_weight.float(), self.teacher_bias)
        logp = torch.zeros(batch, width, logits.shape[-1], device=logits.device)
        logp[rows, cols] = torch.log_softmax(logits, dim=-1)
        ids = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
        in_vocab = self.head.t2d[teacher]
        draft_of = torch.cumsum(self.head.t2d.long(), 0) - 1
        ids[rows, cols] = torch.where(in_vocab, draft_of[teacher], torch.full_like(teacher, IGNORE_INDEX))
        mask = torch.zeros(batch, width, dtype=torch.bool, device=input_ids.device)
        mask[rows, cols + 1] = True
        return {
            "input_ids": input_ids,
            "embeds": self.m.token_embed(input_ids).float(),  # as the proposer embeds (no learned positions)
            "features": features.float(),
            "target_logp": logp,
            "target_ids": ids,
            "loss_mask": mask,
            "position_ids": positions,
        }

    @torch.no_grad()
    def online_records(self, input_ids, labels, lengths) -> dict[str, Any]:
        """The frozen target's records of a batch of conversations, collated as the cache's are."""
        examples = [
            {"input_ids": input_ids[row, :n].tolist(), "labels": labels[row, :n].tolist()}
            for row, n in enumerate(lengths.tolist())
        ]
        records = batch_features(self.m, examples, self.aux, 1, torch.float32)
        return {k: _to(v, input_ids.device) for k, v in collate_records(records, self.aux).items()}

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: dict[str, torch.Tensor] | None = None,
        *,
        rows: torch.Tensor | None = None,
        cols: torch.Tensor | None = None,
        teacher: torch.Tensor | None = None,
        final: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        scored_items: torch.Tensor | None = None,
        **unused: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The TTT loss (``sum_k decay**k * loss_k`` summed over step 0's scored positions, divided by their
        count: this batch's, or ``scored_items``, the whole accumulated batch's, ``step0_items``) of a batch
        of cached records, or (``labels`` and ``lengths`` given: online mode) of conversations."""
        if labels is not None:
            found = self.online_records(input_ids, labels, lengths)
            input_ids, hidden = found["input_ids"], found["hidden"]
            rows, cols, teacher, final = found["rows"], found["cols"], found["teacher"], found["final"]
        batch = self.ttt_batch(input_ids, hidden, rows, cols, teacher=teacher, final=final)
        cfg = self.loss_cfg
        loss_sum, count, metrics = ttt_loss(
            self.head,
            batch,
            steps=cfg["steps"],
            decay=cfg["decay"],
            kind=cfg["kind"],
            prev_correct=cfg["prev_correct"],
        )
        self.last_metrics = {k: v for k, v in metrics.items() if not k.startswith("count")}
        return {"loss": loss_sum / (scored_items if scored_items is not None else max(count, 1))}


def step0_items(batch: dict[str, Any]) -> torch.Tensor:
    """The positions step 0 of ``ttt_loss`` scores in a collated batch: scored positions ``p >= 1`` (a
    score needs the token at ``p + 1`` and a head row before it), from the cached records' ``cols`` or, online,
    from the labels inside each row's length (``feature_records.scored_positions``)."""
    if "cols" in batch:
        return (batch["cols"] >= 1).sum()
    labels, lengths = batch["labels"], batch["lengths"]
    inside = torch.arange(labels.shape[1], device=labels.device)[None] < lengths[:, None]
    return ((labels != IGNORE_INDEX) & inside)[:, 2:].sum()


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, dict):
        return {k: v.to(device) for k, v in value.items()}
    return value.to(device)
