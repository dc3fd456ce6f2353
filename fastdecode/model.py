"""The model (``EarlyExitModel``): the one module that touches Hugging Face model internals.

Everything else in fastdecode (decoders, losses, training wrappers) sees a model as four operations:

    h = m.embed(input_ids, position_ids)                      # [B, T] -> [B, T, H]
    h = m.run_layers(h, start, end, position_ids, ...)        # layers [start, end) on hidden states
    logits = m.exit_logits(h)                                 # final norm (+ projection) + shared LM head
    cache = m.new_cache(batch_size, capacity)                 # explicit KV cache (fastdecode/cache.py)

An exit after block ``l`` is ``m.exit_logits(h_l)`` where ``h_l`` is the residual stream after block ``l``;
the last exit is the model's ordinary output. HF decoder layers are called directly (they are public
``nn.Module``s); nothing in transformers is patched.

For decoding, ``use_engine`` switches the four operations to an execution engine (``fastdecode/engine.py``):
lean layers over fused, pre-packed projections for the rotary families, packed ``FastLinear`` projections in
an inference copy of the HF layers for the others, a packed LM head, the static-shape cache mode and compiled
layer ranges. This module builds it from the HF modules (the only place that reads them); the engine is used
only while gradients are disabled, so training always runs the HF modules.

Adding a model family: write a ``Family`` (which attributes hold the embedding, the layers, the final norm,
whether positions are rotary or learned) and register it in ``FAMILIES`` under HF's ``config.model_type``;
then add ``configs/model/tiny-<family>.yaml`` (a random-init config) and its name to ``TINY_MODELS`` in
``tests/conftest.py``, so the parity and equality tests cover it (docs/ARCHITECTURE.md, "Where to add things").
"""

from __future__ import annotations

import copy
import itertools
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from fastdecode.cache import KVCache, StaticKVCache, attention_mask
from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.engine import Engine, EngineOptions, RotaryLayer, rms_norm, rotary_factors
from fastdecode.fast_linear import FastLinear


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
    residual_writers: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")  # project into the residual


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
        residual_writers=("self_attn.out_proj", "fc2"),
    ),
}
SUPPORTED_ATTENTION = ("sdpa", "eager")
LEAN_FAMILIES = ("llama", "mistral", "qwen2")  # pre-norm rotary layers with SiLU-gated MLPs: RotaryLayer
MAX_COMPILED_STEPS = 32  # compiled layer ranges serve up to this many new tokens (prefills run eagerly)


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
                f"attn_implementation '{attn}' is not supported by EarlyExitModel "
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
        self._engine: Engine | None = None  # the selected execution engine (None: the HF modules)
        self._engines: dict[tuple, Engine] = {}  # built engines, by what their layers depend on
        # Measurements made on this model, kept while it lives (fastdecode/cost.py: the cost model per engine)
        self.measurements: dict[tuple, object] = {}

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
        """An empty preallocated cache for this model (its dtype and device): a ``StaticKVCache`` when the
        selected engine asks for the static-shape mode. ``extra_layers`` more layer slots after the model's
        own (an exit adapter's attention keeps its KV in slot ``num_layers``)."""
        kv_heads, head_dim = self.kv_geometry()
        static = self._engine is not None and self._engine.options.static_cache
        kind = StaticKVCache if static else KVCache
        layers = self.num_layers + extra_layers
        return kind(layers, batch_size, kv_heads, head_dim, capacity, self.dtype, self.device)

    # ----------------------------------------------------------------------------------------------------
    # Execution engine (fastdecode/engine.py)
    @property
    def engine(self) -> Engine | None:
        """The selected engine (None: HF modules); ``use_engine`` selects one."""
        return self._engine

    def use_engine(self, options: EngineOptions | None) -> Engine | None:
        """Decode with an engine built from this model (``options``), or with the HF modules (None).

        Engines are built once per set of layer options and kept; one whose packed weights went stale (a
        parameter modified in place since) is rebuilt. The engine runs only while gradients are disabled.
        """
        if options is None:
            self._engine = None
            return None
        key = (*options.build_key, torch.get_num_threads())  # kernel plans are measured per thread count
        engine = self._engines.get(key)
        if engine is None or engine.stale():
            engine = self._engines[key] = self._build_engine(options)
        engine.options = options
        self._engine = engine
        return engine

    def _running_engine(self) -> Engine | None:
        """The engine, while gradients are off; rebuilt first if a parameter changed since it was built."""
        engine = self._engine
        if engine is None or torch.is_grad_enabled():
            return None
        if engine.stale():
            engine = self.use_engine(engine.options)
        return engine

    def lean_supported(self) -> bool:
        """Whether ``RotaryLayer`` reproduces this model's layers (family, activation, module layout)."""
        cfg = self.config
        if cfg.model_type not in LEAN_FAMILIES or getattr(cfg, "hidden_act", None) != "silu":
            return False
        if getattr(cfg, "partial_rotary_factor", 1.0) != 1.0 or self._rotary is None:
            return False
        if self._norm is None or not hasattr(self._norm, "variance_epsilon"):
            return False
        attn_parts = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")
        for layer in self.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or mlp is None or not all(hasattr(attn, a) for a in attn_parts):
                return False
            if not all(
                isinstance(getattr(mlp, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj")
            ):
                return False
            for norm in ("input_layernorm", "post_attention_layernorm"):
                if not hasattr(getattr(layer, norm, None), "variance_epsilon"):
                    return False
            if len(list(layer.children())) != 4 or len(list(attn.children())) != 4:
                return False  # extra submodules (e.g. q/k norms): not the layout RotaryLayer computes
            if attn.head_dim != self.kv_geometry()[1]:
                return False
        return True

    def _build_engine(self, options: EngineOptions) -> Engine:
        start = time.perf_counter()
        lean = options.fast_layers and self.lean_supported()
        groups: dict[str, list[FastLinear]] = defaultdict(list)
        layers: list[nn.Module] = []
        final_norm = None
        if lean:
            heads = self.config.num_attention_heads
            kv_heads, head_dim = self.kv_geometry()
            for index, layer in enumerate(self.layers):
                attn, mlp = layer.self_attn, layer.mlp
                norms = tuple(
                    (norm.weight, norm.variance_epsilon)
                    for norm in (layer.input_layernorm, layer.post_attention_layernorm)
                )
                lean_layer = RotaryLayer(
                    index,
                    norms,
                    FastLinear.fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
                    FastLinear.fuse([attn.o_proj]),
                    FastLinear.fuse([mlp.gate_proj, mlp.up_proj]),
                    FastLinear.fuse([mlp.down_proj]),
                    heads,
                    kv_heads,
                    head_dim,
                    attn.scaling,
                )
                for name, lin in lean_layer.linears().items():
                    groups[name].append(lin)
                layers.append(lean_layer)
            final_norm = (self._norm.weight.detach(), self._norm.variance_epsilon)
        elif options.fast_linear:
            for layer in self.layers:
                twin = _inference_copy(layer)
                for name, mod in list(twin.named_modules()):
                    if isinstance(mod, nn.Linear):
                        fast = FastLinear.fuse([mod])
                        twin.set_submodule(name, fast)
                        groups[f"{mod.out_features}x{mod.in_features}"].append(fast)
                layers.append(twin)
        else:
            layers = list(self.layers)
        head = FastLinear.fuse([self.lm_head]) if options.fast_linear else None
        if head is not None:
            groups["head"].append(head)
        engine = Engine(options, layers, lean, head, final_norm)
        engine.snapshot(list(self.hf.parameters()))
        engine.plan_all(dict(groups))
        engine.build_seconds = time.perf_counter() - start
        return engine

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
        *,
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
        engine = self._running_engine()
        rotary = None
        if self._rotary is not None:
            rotary = self._rotary(hidden, position_ids=position_ids)
        past = cache.lengths[start] if cache is not None else 0  # before this call writes anything
        steps = hidden.shape[1]
        if cache is not None:
            cache.begin(past, steps)
        masks: dict[int | None, torch.Tensor | None] = {}
        for window in {self._windows[idx] for idx in range(start, end)}:
            masks[window] = self._mask(hidden, attention_mask, cache, past, window, position_ids, engine)
        if engine is not None and engine.lean:
            factors = rotary_factors(*rotary)
            windows = tuple(self._windows[idx] for idx in range(start, end))
            if engine.options.compile and cache is not None and cache.static and steps <= MAX_COMPILED_STEPS:
                keys = tuple(masks)
                run = engine.compiled_range(
                    start, end, steps, _lean_range(engine.layers[start:end], windows, keys)
                )
                hidden = run(hidden, *factors, tuple(masks[k] for k in keys), cache)
            else:
                for idx, window in zip(range(start, end), windows, strict=True):
                    hidden = engine.layers[idx](hidden, factors, masks[window], cache)
        else:
            layers = engine.layers if engine is not None else self.layers
            extra = {} if rotary is None else {"position_embeddings": rotary}
            for idx in range(start, end):
                hidden = layers[idx](
                    hidden,
                    attention_mask=masks[self._windows[idx]],
                    position_ids=position_ids,
                    cache=cache,
                    use_cache=cache is not None,
                    **extra,
                )
        if cache is not None:
            cache.finish(range(start, end), steps)
        return hidden

    def _mask(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
        past: int,
        window: int | None,
        position_ids: torch.Tensor,
        engine: Engine | None = None,
    ) -> torch.Tensor | None:
        num_queries = hidden.shape[1]
        if mask is not None:
            return mask
        if cache is not None:
            end = past + num_queries
            if engine is not None and self._maskless(cache, past, num_queries, window, engine):
                return None
            span = cache.attended(end)
            key_pos = cache.key_pos[:, :span] if window is not None else None
            return attention_mask(
                cache.key_valid[:, :span],
                past,
                num_queries,
                hidden.dtype,
                window,
                key_pos=key_pos,
                query_pos=position_ids,
            )
        if num_queries == 1 or (window is None and self.config._attn_implementation == "sdpa"):
            return None  # SDPA applies causality itself (is_causal) when no mask is given
        valid = torch.ones(hidden.shape[0], num_queries, dtype=torch.bool, device=hidden.device)
        return attention_mask(valid, 0, num_queries, hidden.dtype, window)

    def _maskless(self, cache: KVCache, past: int, steps: int, window: int | None, engine: Engine) -> bool:
        """Whether the queries need no materialised mask: a dynamic cache on the CPU (where checking is free)
        with every slot valid, no sliding window, and one query (full attention) or a causal block from slot
        0 (SDPA's ``is_causal``; HF's eager attention ignores it, so only under SDPA or the lean layers)."""
        if cache.static or window is not None or cache.key_valid.device.type != "cpu":
            return False
        if steps > 1 and (past != 0 or not (engine.lean or self.config._attn_implementation == "sdpa")):
            return False
        return bool(cache.key_valid[:, : past + steps].all())

    def exit_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm (and output projection) of a residual stream: ``[..., H] -> [..., H_out]``."""
        engine = self._running_engine()
        if engine is not None and engine.final_norm is not None:
            return rms_norm(hidden, *engine.final_norm)
        if self._norm is not None:
            hidden = self._norm(hidden)
        if self._project_out is not None:
            hidden = self._project_out(hidden)
        return hidden

    def exit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of an exit: shared final norm + LM head on ``hidden [..., H]`` -> ``[..., V]``."""
        engine = self._running_engine()
        if engine is not None and engine.head is not None:
            return engine.head(self.exit_hidden(hidden))
        return self.lm_head(self.exit_hidden(hidden))

    def exit_logits_subset(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits of an exit over the vocabulary rows ``ids [S]`` only: ``[..., H] -> [..., S]``; column j
        is the logit of token ``ids[j]``, exactly ``exit_logits(hidden)[..., ids]`` up to rounding.

        Why: a cheaper draft head (``fastdecode/draft_vocab.py``). The head rows are gathered once per
        ``ids`` tensor (pass the same tensor object every step) and again after the head's weights change;
        they are detached: this head is for decoding, not for training.
        """
        weight = self.lm_head.weight
        engine = self._running_engine()
        if engine is not None and engine.head is not None:
            return engine.subset_head(ids, weight, self.lm_head.bias)(self.exit_hidden(hidden))
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
    def adapter_block(self, kind: str, source: int, slot: int, zero_residual: bool = False) -> nn.Module:
        """A trainable copy of decoder layer ``source`` whose attention keeps its KV in cache layer ``slot``.

        ``kind="block"``: the whole decoder layer. ``kind="attention"``: Kangaroo's adapter (Liu et al., 2024),
        the layer's pre-attention norm and self-attention with its residual, then a second norm of the same
        type (weight 1, bias 0: at initialisation it changes nothing, since the shared final norm follows).
        ``zero_residual``: zero the projections that write into the residual stream (``Family.residual_writers``),
        so the block starts as the identity (the drafter starts as the raw exit) and learns a correction.
        The model's own layers are untouched (deep copies; ``requires_grad`` on).
        """
        layer = copy.deepcopy(self.layers[source])
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = slot
        if zero_residual:
            with torch.no_grad():
                for path in self.family.residual_writers:
                    for param in _get(layer, path).parameters():
                        param.zero_()
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
        *,
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


def _inference_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s module tree sharing its parameters and buffers (nothing is duplicated), whose
    submodules can be swapped without touching the original."""
    memo = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo)


def _lean_range(layers: list[nn.Module], windows: tuple, keys: tuple):
    """The function ``torch.compile`` traces for a range of lean layers: masks by window key."""
    slots = tuple(keys.index(window) for window in windows)

    def run(hidden, cos, sin, masks, cache):
        for layer, slot in zip(layers, slots, strict=True):
            hidden = layer(hidden, (cos, sin), masks[slot], cache)
        return hidden

    return run


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
        *,
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
