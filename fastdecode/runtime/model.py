"""The model (``EarlyExitModel``): the seam every other part of fastdecode reaches a HF model through.

Everything else sees a model as four operations: ``embed``, ``run_layers`` (layers ``[start, end)``),
``exit_logits`` (final norm and the shared LM head, at any exit) and ``new_cache``. HF decoder layers are
called directly; nothing in transformers is patched. For decoding, ``use_engine`` switches the operations to
the execution engine (``fastdecode/runtime/engine.py``) while gradients are disabled; ``lock`` serialises
the calls on one HF model (``model_lock``). The seam's four modules and the engine: docs/design/runtime.md.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from fastdecode.config import ConfigError
from fastdecode.runtime.cache import KVCache, StaticKVCache, layer_mask
from fastdecode.runtime.engine import Engine, EngineOptions, rms_norm, rotary_factors
from fastdecode.runtime.engine_build import build_engine, lean_range, lean_supported
from fastdecode.runtime.exit_blocks import exit_block
from fastdecode.runtime.families import family_of, kv_geometry, submodule
from fastdecode.runtime.model_lock import model_lock
from fastdecode.runtime.weights import Weights, resolve_weights

SUPPORTED_ATTENTION = ("sdpa", "eager")
MAX_COMPILED_STEPS = 32  # compiled layer ranges serve up to this many new tokens (prefills run eagerly)


class EarlyExitModel:
    """Wraps a HF ``*ForCausalLM`` model; the wrapped model stays the owner of every parameter.

    Args:
        model: a loaded HF causal LM of a family in ``FAMILIES``.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        family = family_of(model.config.model_type)
        attn = getattr(model.config, "_attn_implementation", "sdpa")
        if attn not in SUPPORTED_ATTENTION:
            raise ConfigError(
                f"attn_implementation '{attn}' is not supported by EarlyExitModel "
                f"(it passes explicit 4D masks); use one of {SUPPORTED_ATTENTION} (model.attn_implementation)."
            )
        self.hf = model
        self.family = family
        self.lock = model_lock(model)  # held by a whole call (``FastDecoder.generate``) and by ``use_engine``
        backbone = submodule(model, family.backbone)
        self._embed_tokens = submodule(backbone, family.embed_tokens)
        self.layers: nn.ModuleList = submodule(backbone, family.layers)
        self._norm = submodule(backbone, family.final_norm)
        self._rotary = submodule(backbone, family.rotary)
        self._embed_positions = submodule(backbone, family.embed_positions)
        self._project_in = submodule(backbone, family.project_in)
        self._project_out = submodule(backbone, family.project_out)
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self._windows = [self._sliding_window(i) for i in range(len(self.layers))]
        # (ids, head weight version, weight rows [S, H_out], bias [S] | None): see ``exit_logits_subset``
        self._head_subset: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None] | None = None
        self._engine: Engine | None = None  # the selected execution engine (None: the HF modules)
        self._engines: dict[tuple, Engine] = {}  # built engines, by what their layers depend on
        self._linears: list[nn.Linear] | None = None  # every product the engine computes (resolve_weights)
        # Measurements made on this model, kept while it lives (fastdecode/plan/cost.py: the cost model per engine)
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
        return kv_geometry(self.config)

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
    # Execution engine (fastdecode/runtime/engine.py)
    @property
    def engine(self) -> Engine | None:
        """The selected engine (None: HF modules); ``use_engine`` selects one."""
        return self._engine

    def use_engine(self, options: EngineOptions | None) -> Engine | None:
        """Decode with an engine built from this model (``options``), or with the HF modules (None).

        Engines are built once per set of layer options and kept; one whose packed weights went stale (a
        parameter modified in place since) is rebuilt. The engine runs only while gradients are disabled.
        Takes ``lock``: a switch waits for a call another thread holds it for (``FastDecoder.generate``).
        """
        with self.lock:
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
        return lean_supported(
            self.config, self.family, self.layers, final_norm=self._norm, rotary=self._rotary
        )

    def resolve_weights(self, requested: str) -> Weights:
        """``decoder.weights`` for this model (``runtime/weights.py``): what the engine's products read."""
        if self._linears is None:  # the module tree does not change; its parameters may (checked there)
            found = [mod for layer in self.layers for mod in layer.modules() if isinstance(mod, nn.Linear)]
            self._linears = [*found, self.lm_head]
        return resolve_weights(requested, self.hf, self._linears, self.device)

    def _build_engine(self, options: EngineOptions) -> Engine:
        lean = options.fast_layers and self.lean_supported()
        return build_engine(self.hf, self.layers, options, lean=lean, final_norm=self._norm)

    # ----------------------------------------------------------------------------------------------------
    # The four operations
    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token (+ learned position) embeddings: ``[B, T]`` ids and positions -> ``[B, T, H]``."""
        h = self.token_embed(input_ids)
        if self._embed_positions is not None:
            # OPT's learned positions: the module adds its own offset when given explicit position ids.
            h = h + self._embed_positions(None, 0, position_ids=position_ids).to(h.dtype)
        return h

    def token_embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The plain token embedding ``[B, T]`` ids -> ``[B, T, H]`` (after OPT's input projection, without
        learned positions): what an EAGLE-3 head reads beside the target's features."""
        h = self._embed_tokens(input_ids)
        return h if self._project_in is None else self._project_in(h)

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
            hidden = self._run_lean(engine, hidden, range(start, end), rotary, masks, cache)
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

    def _run_lean(
        self,
        engine: Engine,
        hidden: torch.Tensor,
        span: range,
        rotary: tuple[torch.Tensor, torch.Tensor],
        masks: dict[int | None, torch.Tensor | None],
        cache: KVCache | None,
    ) -> torch.Tensor:
        """The engine's lean layers ``span`` on ``hidden [B, T, H]``: compiled as one range on a static cache
        (up to ``MAX_COMPILED_STEPS`` new tokens), else layer by layer."""
        factors = rotary_factors(*rotary)
        windows = tuple(self._windows[idx] for idx in span)
        steps = hidden.shape[1]
        if engine.options.compile and cache is not None and cache.static and steps <= MAX_COMPILED_STEPS:
            keys = tuple(masks)
            layers = engine.layers[span.start : span.stop]
            run = engine.compiled_range(span.start, span.stop, steps, lean_range(layers, windows, keys))
            return run(hidden, *factors, tuple(masks[k] for k in keys), cache)
        for idx, window in zip(span, windows, strict=True):
            hidden = engine.layers[idx](hidden, factors, masks[window], cache)
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
        """``mask`` when given, else the one ``fastdecode.runtime.cache.layer_mask`` builds (or None: none needed)."""
        if mask is not None:
            return mask
        sdpa = self.config._attn_implementation == "sdpa"
        lean = None if engine is None else engine.lean
        return layer_mask(hidden, cache, past, window, position_ids, sdpa=sdpa, engine_lean=lean)

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
        return self.head_logits(self.exit_hidden(hidden))

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head alone on a normed ``[..., H']`` (``exit_hidden``'s output) -> ``[..., V]``: the engine's
        (its weights, ``decoder.weights``) while it runs, else the HF module."""
        engine = self._running_engine()
        if engine is not None and engine.head is not None:
            return engine.head(normed)
        return self.lm_head(normed)

    def exit_logits_subset(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits of an exit over the vocabulary rows ``ids [S]`` only: ``[..., H] -> [..., S]``; column j
        is the logit of token ``ids[j]``, exactly ``exit_logits(hidden)[..., ids]`` up to rounding.

        Why: a cheaper draft head (``fastdecode/data/draft_vocab.py``; docs/design/data.md). The head rows
        are gathered once per ``ids`` tensor (pass the same tensor object every step) and again after the
        head's weights change; they are detached: this head is for decoding, not for training.
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
    # Exit adapters (fastdecode/drafters/exits/adapter.py): blocks of this family outside the model's layer stack
    def adapter_block(self, kind: str, source: int, slot: int, zero_residual: bool = False) -> nn.Module:
        """A trainable copy of decoder layer ``source`` whose attention keeps its KV in cache layer ``slot``
        (``fastdecode/runtime/exit_blocks.py``: the kinds, ``zero_residual``); the model's own layers are untouched."""
        return exit_block(self.layers[source], self.family, kind, slot, zero_residual=zero_residual)

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
