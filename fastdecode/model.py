"""The early-exit model adapter: the one module that touches Hugging Face model internals.

Everything else in fastdecode (decoders, losses, training wrappers) sees a model as four operations:

    h = m.embed(input_ids, position_ids)                      # [B, T] -> [B, T, H]
    h = m.run_layers(h, start, end, position_ids, ...)        # layers [start, end) on hidden states
    logits = m.exit_logits(h)                                 # final norm (+ projection) + shared LM head
    cache = m.new_cache(batch_size, capacity)                 # explicit KV cache (fastdecode/cache.py)

An exit after block ``l`` is ``m.exit_logits(h_l)`` where ``h_l`` is the residual stream after block ``l``;
the last exit is the model's ordinary output. HF decoder layers are called directly (they are public
``nn.Module``s); nothing in transformers is patched.

Adding a model family: write a ``Family`` (which attributes hold the embedding, the layers, the final norm,
whether positions are rotary or learned) and register it in ``FAMILIES`` under HF's ``config.model_type``;
then add a tiny config to ``tests/test_model_adapter.py`` so the parity tests cover it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from fastdecode.cache import KVCache, attention_mask
from fastdecode.config import ConfigError, unknown_name_error


@dataclass(frozen=True)
class Family:
    """Where a model family keeps its parts (attribute paths from the ``*ForCausalLM`` object)."""

    backbone: str  # module holding the parts below, e.g. "model" or "model.decoder"
    embed_tokens: str = "embed_tokens"
    layers: str = "layers"
    final_norm: str | None = "norm"
    rotary: str | None = "rotary_emb"  # rotary embedding module; None for learned positions
    embed_positions: str | None = None  # learned absolute positions (OPT)
    project_in: str | None = None  # optional projections (OPT-350m)
    project_out: str | None = None
    attn_norm: str = "input_layernorm"  # a decoder layer's norm before its self-attention (exit adapters)


ROTARY_DECODER = Family(backbone="model")
FAMILIES: dict[str, Family] = {
    "llama": ROTARY_DECODER,  # Llama 2/3, CodeLlama, SmolLM2, LayerSkip checkpoints
    "mistral": ROTARY_DECODER,
    "qwen2": ROTARY_DECODER,
    "opt": Family(
        backbone="model.decoder",
        final_norm="final_layer_norm",
        rotary=None,
        embed_positions="embed_positions",
        project_in="project_in",
        project_out="project_out",
        attn_norm="self_attn_layer_norm",
    ),
}
SUPPORTED_ATTENTION = ("sdpa", "eager")


def _get(module: nn.Module, path: str | None) -> nn.Module | None:
    if path is None:
        return None
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


class EarlyExitModel:
    """Wraps a HF ``*ForCausalLM`` model; the wrapped model stays the owner of every parameter.

    Args:
        model: a loaded HF causal LM of a family in ``FAMILIES``.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        model_type = model.config.model_type
        if model_type not in FAMILIES:
            raise unknown_name_error(
                "model family",
                model_type,
                list(FAMILIES),
                "Add it in fastdecode/model.py (see its docstring).",
            )
        attn = getattr(model.config, "_attn_implementation", "sdpa")
        if attn not in SUPPORTED_ATTENTION:
            raise ConfigError(
                f"attn_implementation '{attn}' is not supported by the early-exit adapter "
                f"(it passes explicit 4D masks); use one of {SUPPORTED_ATTENTION} (model.attn_implementation)."
            )
        self.hf = model
        self.family = FAMILIES[model_type]
        backbone = _get(model, self.family.backbone)
        self._embed_tokens = _get(backbone, self.family.embed_tokens)
        self.layers: nn.ModuleList = _get(backbone, self.family.layers)
        self._norm = _get(backbone, self.family.final_norm)
        self._rotary = _get(backbone, self.family.rotary)
        self._embed_positions = _get(backbone, self.family.embed_positions)
        self._project_in = _get(backbone, self.family.project_in)
        self._project_out = _get(backbone, self.family.project_out)
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self._windows = [self._sliding_window(i) for i in range(len(self.layers))]
        # (ids, head weight version, weight rows [S, H_out], bias [S] | None): see ``exit_logits_subset``
        self._head_subset: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None] | None = None

    # ----------------------------------------------------------------------------------------------------
    # Geometry
    @property
    def config(self):
        return self.hf.config

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def step_cost(self, depth: int | None = None, head_rows: int | None = None) -> int:
        """Weights read to decode one token through layers ``[0, depth)`` (all by default) and an LM head of
        ``head_rows`` rows (the full vocabulary by default): the cost of a memory-bound decoding step, used to
        compare a drafter with its target. Embeddings are a lookup and do not count."""
        depth = self.num_layers if depth is None else depth
        layers = sum(p.numel() for layer in self.layers[:depth] for p in layer.parameters())
        rows = self.vocab_size if head_rows is None else head_rows
        return layers + rows * self.lm_head.in_features

    def kv_geometry(self) -> tuple[int, int]:
        """(number of KV heads, head dim) of every layer."""
        cfg = self.config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return kv_heads, head_dim

    def _sliding_window(self, layer: int) -> int | None:
        cfg = self.config
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer] == "sliding_attention" else None
        if getattr(cfg, "use_sliding_window", True) is False:
            return None
        return window

    def new_cache(self, batch_size: int, capacity: int, extra_layers: int = 0) -> KVCache:
        """An empty preallocated cache for this model (its dtype and device); ``extra_layers`` more layer
        slots after the model's own (an exit adapter's attention keeps its KV in slot ``num_layers``)."""
        kv_heads, head_dim = self.kv_geometry()
        layers = self.num_layers + extra_layers
        return KVCache(layers, batch_size, kv_heads, head_dim, capacity, self.dtype, self.device)

    # ----------------------------------------------------------------------------------------------------
    # The four operations
    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token (+ learned position) embeddings: ``[B, T]`` ids and positions -> ``[B, T, H]``."""
        h = self._embed_tokens(input_ids)
        if self._project_in is not None:
            h = self._project_in(h)
        if self._embed_positions is not None:
            # OPT's learned positions: the module adds its own offset when given explicit position ids.
            h = h + self._embed_positions(None, 0, position_ids=position_ids).to(h.dtype)
        return h

    def run_layers(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Run decoder layers ``[start, end)`` on ``hidden [B, T, H]`` at ``position_ids [B, T]``.

        ``attention_mask``: additive ``[B, 1, T, S]`` or None. With None and no cache the layers attend
        causally within the T positions; with a cache the mask is built from ``cache.key_valid`` for queries
        at slots ``cache.lengths[start] ..`` (the caller reserves those slots, with their validity and
        positions, first: see ``forward``).
        """
        if not 0 <= start <= end <= self.num_layers:
            raise ValueError(f"layer range [{start}, {end}) outside [0, {self.num_layers}]")
        if start == end:
            return hidden
        extra = {}
        if self._rotary is not None:
            extra["position_embeddings"] = self._rotary(hidden, position_ids=position_ids)
        past = cache.lengths[start] if cache is not None else 0  # before this call writes anything
        masks: dict[int | None, torch.Tensor | None] = {}
        for idx in range(start, end):
            window = self._windows[idx]
            if window not in masks:
                masks[window] = self._mask(hidden, attention_mask, cache, past, window, position_ids)
            hidden = self.layers[idx](
                hidden,
                attention_mask=masks[window],
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                **extra,
            )
        return hidden

    def _mask(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
        past: int,
        window: int | None,
        position_ids: torch.Tensor,
    ) -> torch.Tensor | None:
        num_queries = hidden.shape[1]
        if mask is not None:
            return mask
        if cache is not None:
            end = past + num_queries
            key_pos = cache.key_pos[:, :end] if window is not None else None
            return attention_mask(
                cache.key_valid[:, :end], past, num_queries, hidden.dtype, window, key_pos, position_ids
            )
        if num_queries == 1 or (window is None and self.config._attn_implementation == "sdpa"):
            return None  # SDPA applies causality itself (is_causal) when no mask is given
        valid = torch.ones(hidden.shape[0], num_queries, dtype=torch.bool, device=hidden.device)
        return attention_mask(valid, 0, num_queries, hidden.dtype, window)

    def exit_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm (and output projection) of a residual stream: ``[..., H] -> [..., H_out]``."""
        if self._norm is not None:
            hidden = self._norm(hidden)
        if self._project_out is not None:
            hidden = self._project_out(hidden)
        return hidden

    def exit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of an exit: shared final norm + LM head on ``hidden [..., H]`` -> ``[..., V]``."""
        return self.lm_head(self.exit_hidden(hidden))

    def exit_logits_subset(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits of an exit over the vocabulary rows ``ids [S]`` only: ``[..., H] -> [..., S]``; column j
        is the logit of token ``ids[j]``, exactly ``exit_logits(hidden)[..., ids]`` up to rounding.

        Why: a cheaper draft head (``fastdecode/draft_vocab.py``). The head rows are gathered once per
        ``ids`` tensor (pass the same tensor object every step) and again after the head's weights change;
        they are detached: this head is for decoding, not for training.
        """
        weight = self.lm_head.weight
        cached = self._head_subset
        if cached is None or cached[0] is not ids or cached[1] != weight._version:
            bias = self.lm_head.bias
            rows = weight.detach().index_select(0, ids)
            cached = (
                ids,
                weight._version,
                rows,
                None if bias is None else bias.detach().index_select(0, ids),
            )
            self._head_subset = cached
        return torch.nn.functional.linear(self.exit_hidden(hidden), cached[2], cached[3])

    # ----------------------------------------------------------------------------------------------------
    # Exit adapters (fastdecode/exit_adapter.py): blocks of this family outside the model's layer stack
    def adapter_block(self, kind: str, source: int, slot: int) -> nn.Module:
        """A trainable copy of decoder layer ``source`` whose attention keeps its KV in cache layer ``slot``.

        ``kind="block"``: the whole decoder layer. ``kind="attention"``: Kangaroo's adapter (Liu et al., 2024),
        the layer's pre-attention norm and self-attention with its residual, then a second norm of the same
        type (weight 1, bias 0: at initialisation it changes nothing, since the shared final norm follows).
        The model's own layers are untouched (deep copies; ``requires_grad`` on).
        """
        layer = copy.deepcopy(self.layers[source])
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = slot
        if kind == "block":
            block = layer
        elif kind == "attention":
            if getattr(layer, "do_layer_norm_before", True) is False:
                raise ConfigError(
                    "the 'attention' exit adapter needs a pre-norm model (this one normalises after "
                    "attention, do_layer_norm_before=False); use the 'block' adapter kind."
                )
            norm = _get(layer, self.family.attn_norm)
            out_norm = copy.deepcopy(norm)
            with torch.no_grad():
                for name, param in out_norm.named_parameters():
                    param.fill_(1.0 if name == "weight" else 0.0)
            block = AttentionBlock(norm, layer.self_attn, out_norm)
        else:
            raise unknown_name_error("exit adapter kind", kind, ["block", "attention"])
        return block.requires_grad_(True)

    def run_block(
        self,
        block: nn.Module,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        slot: int,
        window: int | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Run ``block`` (from ``adapter_block``) on ``hidden [B, T, H]`` like one more layer whose KV lives in
        cache layer ``slot``; masks as in ``run_layers`` (``window``: its sliding window, None for full)."""
        extra = {}
        if self._rotary is not None:
            extra["position_embeddings"] = self._rotary(hidden, position_ids=position_ids)
        past = cache.lengths[slot] if cache is not None else 0
        mask = self._mask(hidden, attention_mask, cache, past, window, position_ids)
        return block(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            **extra,
        )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: full attention)."""
        return self._windows[layer]

    # ----------------------------------------------------------------------------------------------------
    # Convenience
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        exit_layer: int | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` of ``input_ids [B, T]`` through layers ``[0, exit_layer)`` (all by default).

        With a cache, the tokens take the next slots; ``valid [B, T]`` marks padding (False) in them, and
        positions default to the slot indices.
        """
        exit_layer = self.num_layers if exit_layer is None else exit_layer
        batch, num_new = input_ids.shape
        past = cache.lengths[0] if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + num_new, device=input_ids.device).expand(batch, -1)
        if cache is not None:
            if valid is None:
                valid = torch.ones(batch, num_new, dtype=torch.bool, device=input_ids.device)
            cache.reserve(valid, past, position_ids)
        hidden = self.embed(input_ids, position_ids)
        hidden = self.run_layers(hidden, 0, exit_layer, position_ids, cache=cache)
        return self.exit_logits(hidden)


class AttentionBlock(nn.Module):
    """Kangaroo's exit adapter: ``out_norm(h + self_attn(norm(h)))`` with a Hugging Face attention module."""

    def __init__(self, norm: nn.Module, self_attn: nn.Module, out_norm: nn.Module) -> None:
        super().__init__()
        self.norm, self.self_attn, self.out_norm = norm, self_attn, out_norm

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        use_cache: bool = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        kwargs = {"position_embeddings": position_embeddings} if position_embeddings is not None else {}
        out, _ = self.self_attn(
            hidden_states=self.norm(hidden),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            **kwargs,
        )
        return self.out_norm(hidden + out)
