"""``WrappedLM``: the base of the modules a Trainer trains around a HF causal LM (LayerSkip, CLLM, SkipDecode).

Why a wrapper module: under DDP and DeepSpeed the loss must be computed inside the forward of the wrapped
module, or the gradient reducer is bypassed and ranks silently train apart. So a method's forward (layer
dropout, a layer-skipping policy, its loss) lives in a subclass's ``forward``, and the Trainer wraps the
subclass like any model. This base owns what every such wrapper needs to save, reload and checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from fastdecode.runtime.cache import attention_mask
from fastdecode.runtime.model import EarlyExitModel

__all__ = ["WrappedLM", "causal_mask_from_padding"]


def causal_mask_from_padding(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A collator's mask as ``EarlyExitModel.run_layers`` wants it: ``[B, T]`` 0/1 (or bool) padding mask -> additive
    causal ``[B, 1, T, T]`` of ``dtype``; a 4D mask (packed rows, already block-causal) is returned as is.

    A 2D mask without padding becomes None, so SDPA runs its causal kernel. (Unlike
    ``fastdecode.data.chat.additive_from_bool``, which converts a mask's values only, this adds causality.)
    """
    if mask is None or mask.dim() == 4:
        return mask
    if bool(mask.all()):
        return None
    return attention_mask(mask.bool(), 0, mask.shape[1], dtype)


class WrappedLM(nn.Module):
    """Holds ``model`` (a HF causal LM, possibly a peft model) and ``m``, the model as ``EarlyExitModel`` (the
    model seam every method's forward runs through; named ``m`` as everywhere in fastdecode).

    Subclasses implement ``forward(input_ids, labels, ..., num_items_in_batch=None) -> {"loss": ...}``.
    """

    loss_type = "ForCausalLM"  # tells the Trainer the labels are shifted inside (token counting)
    accepts_loss_kwargs = True  # the loss is normalised by num_items_in_batch (gradient accumulation)

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.m = EarlyExitModel(base)
        self.config = base.config
        self._keys_to_ignore_on_save = self._tied_aliases()  # the Trainer's name for keys not saved

    def _tied_aliases(self) -> list[str]:
        """State-dict keys that alias an earlier key (a tied LM head): saved once, re-tied on load."""
        seen: set[tuple[int, tuple]] = set()
        aliases = []
        for key, tensor in super().state_dict(keep_vars=True).items():
            ident = (tensor.data_ptr(), tuple(tensor.shape))
            if ident in seen and tensor.numel() > 0:
                aliases.append(key)
            seen.add(ident)
        return aliases

    def state_dict(self, *args, **kwargs):
        """Without the tied aliases, so checkpoints save with safetensors (which refuses shared tensors)."""
        state = super().state_dict(*args, **kwargs)
        for key in self._keys_to_ignore_on_save:
            state.pop(key, None)
        return state

    def activation_checkpointing_enable(self, **kwargs) -> None:
        """The Trainer's ``activation_checkpointing=true``: recompute each block in backward.

        ``EarlyExitModel`` calls HF's own layers, which checkpoint themselves once this is on.
        """
        self.model.activation_checkpointing_enable(**kwargs)

    def tie_weights(self) -> None:
        """Called by the Trainer after loading a checkpoint whose only missing keys are the aliases."""
        self.model.tie_weights()
