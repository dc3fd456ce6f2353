"""``AdapterLM``: the module the Trainer trains. The frozen model is held outside the module tree, so only
the adapters are parameters, are saved in checkpoints and see the optimiser."""

from __future__ import annotations

import torch
from torch import nn

from adapter_train.config import LossConfig
from adapter_train.losses import agreement, cross_entropy, kl_full, kl_topk
from fastdecode.drafters.exits.adapter import ExitAdapter
from fastdecode.runtime.model import EarlyExitModel


class AdapterLM(nn.Module):
    """One adapter per exit, trained on cached features (``fastdecode/training/features.py``).

    Args:
        m: the frozen model (its final norm and LM head are the drafter's head; never trained).
        adapters: exit E -> adapter.
        loss: the loss settings.
        vocab: the draft vocabulary ``[S]`` the drafter's head scores (None: the full head).
    """

    def __init__(
        self,
        m: EarlyExitModel,
        adapters: dict[int, ExitAdapter],
        loss: LossConfig,
        vocab: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.adapters = nn.ModuleDict({str(e): a for e, a in sorted(adapters.items())})
        self._frozen = (m,)  # a tuple: not a submodule, so neither trained nor saved
        self.loss_cfg = loss
        weight = m.lm_head.weight.detach()
        bias = None if m.lm_head.bias is None else m.lm_head.bias.detach()
        rows = torch.arange(m.vocab_size, device=weight.device) if vocab is None else vocab.to(weight.device)
        index = torch.full((m.vocab_size,), -1, dtype=torch.long, device=weight.device)
        index[rows] = torch.arange(len(rows), device=weight.device)
        self.register_buffer("head_weight", weight if vocab is None else weight[rows], persistent=False)
        self.register_buffer("head_bias", None if bias is None else bias[rows], persistent=False)
        self.register_buffer("row_of", index, persistent=False)
        self.last_metrics: dict[str, float] = {}

    @property
    def m(self) -> EarlyExitModel:
        return self._frozen[0]

    def head(self, adapted: torch.Tensor) -> torch.Tensor:
        """Drafter logits over the head rows: shared final norm (frozen) + the LM head's rows."""
        return nn.functional.linear(self.m.exit_hidden(adapted), self.head_weight, self.head_bias)

    def forward(
        self,
        hidden: dict[str, torch.Tensor],
        position_ids: torch.Tensor,
        *,
        rows: torch.Tensor,
        cols: torch.Tensor,
        targets: torch.Tensor,
        teacher: torch.Tensor,
        topk_ids: torch.Tensor | None = None,
        topk_logp: torch.Tensor | None = None,
        final: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        cfg = self.loss_cfg
        teacher_logits = None
        if cfg.target == "full":
            with torch.no_grad():
                teacher_logits = nn.functional.linear(final, self.head_weight, self.head_bias)
        total = torch.zeros((), device=position_ids.device)
        metrics = {}
        for name, adapter in self.adapters.items():
            # Right-padded rows, causal attention: real positions never attend to padding.
            adapted = adapter(self.m, hidden[name], position_ids)
            student = self.head(adapted[rows, cols])  # [M, S]
            loss = torch.zeros((), device=student.device)
            if cfg.kl_weight > 0:
                if teacher_logits is not None:
                    kl = kl_full(student, teacher_logits, cfg.temperature)
                else:
                    kl = kl_topk(student, self.row_of[topk_ids], topk_logp, cfg.temperature)
                loss = loss + cfg.kl_weight * kl
                metrics[f"kl/E{name}"] = float(kl.detach())
            if cfg.ce_weight > 0:
                ce = cross_entropy(student, self.row_of[targets])
                loss = loss + cfg.ce_weight * ce
                metrics[f"ce/E{name}"] = float(ce.detach())
            metrics[f"agree/E{name}"] = float(agreement(student, self.row_of[teacher]))
            total = total + loss
        self.last_metrics = metrics
        return {"loss": total}
