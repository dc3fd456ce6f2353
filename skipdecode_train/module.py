"""``SkipDecodeLM``: the module the Trainer trains; its forward runs the SkipDecode policy exactly and
returns the final-layer cross-entropy (Del Corro et al., 2023: fine-tune with the inference policy).

The forward is ``fastdecode.skipdecode.policy_hidden`` (each layer on the prefix of positions that run it),
so the trained computation is exactly what ``fastdecode/decoding/skipdecode.py`` runs token by token.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from fastdecode.config import ConfigError
from fastdecode.skipdecode import SkipDecodePolicy, policy_hidden
from fastdecode.tokens import next_token_nll
from fastdecode.training.wrapped_lm import WrappedLM

__all__ = ["SkipDecodeLM", "check_right_padded"]


def check_right_padded(attention_mask: torch.Tensor | None) -> None:
    """The policy forward uses no mask: rows must be right-padded 0/1 ``[B, T]`` masks (or None).

    A 4D mask means packed rows, whose samples would share one budget schedule: refused.
    """
    if attention_mask is None:
        return
    if attention_mask.dim() != 2:
        raise ConfigError(
            "skipdecode trains on one conversation per row (each has its own response start); "
            "set data.packing=false."
        )
    mask = attention_mask.bool()
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ConfigError("skipdecode needs right-padded rows (padding after the tokens), got left padding.")


class SkipDecodeLM(WrappedLM):
    """Wraps a HF causal LM; ``forward(input_ids, labels, ...)`` returns ``{"loss"}`` under ``policy``.

    Args:
        model: the HF model (possibly a peft model: its base model's layers are used).
        policy: the SkipDecode policy, built for this model's number of layers.
    """

    def __init__(self, model: PreTrainedModel, policy: SkipDecodePolicy) -> None:
        super().__init__(model)
        if policy.num_layers != self.m.num_layers:
            raise ValueError(f"policy for {policy.num_layers} layers, model has {self.m.num_layers}")
        self.policy = policy

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **_: object,
    ) -> dict:
        """Final-layer CE of ``input_ids/labels [B, T]`` (HF label convention, shifted here).

        The sum of token losses is divided by ``num_items_in_batch`` (label tokens of the whole accumulated
        batch, as HF's ``ForCausalLMLoss``) or, without it, by this batch's label tokens.
        """
        check_right_padded(attention_mask)
        hidden = policy_hidden(self.m, self.policy, input_ids, labels, position_ids)  # [B, T, H]
        total, scored = next_token_nll(hidden, labels, self.m.exit_logits)  # head on labels only
        denom = num_items_in_batch if num_items_in_batch is not None else max(scored, 1)
        if isinstance(denom, torch.Tensor):
            denom = denom.to(total.device)
        return {"loss": total / denom}
