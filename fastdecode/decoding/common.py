"""What every decoding strategy shares: the checks, prompt batching and prefill, logits processing, rows.

Every strategy is a free function ``generate(m, prompts, cfg, draft=None) -> DecodeOutput`` (each one is
named in ``fastdecode/registry.py``); its config and output record are ``config.py``'s. A batch's prompts are
left-padded into one ``[B, W]`` block, and each row counts positions from 0 at its first real token, so a
batched row decodes like the same row alone. ``Rows`` keeps the tokens emitted per row; ``streaming`` hooks
them as they are emitted.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from fastdecode.config import ConfigError
from fastdecode.decoding.config import DecodeConfig
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.engine import default_options
from fastdecode.runtime.model import EarlyExitModel


def configure_engine(m: EarlyExitModel, cfg: DecodeConfig) -> None:
    """Select the model's execution engine for this call from ``cfg`` (``fastdecode/runtime/engine.py``): every decoder
    calls it after its checks, before any work (the cost model measures the engine that decodes)."""
    m.use_engine(
        default_options(
            m.device,
            fast_layers=cfg.fast_layers,
            fast_linear=cfg.fast_linear,
            kernel=cfg.linear_kernel,
            static_cache=cfg.static_cache,
            compile=cfg.compile,
            weights=m.resolve_weights(cfg.weights),
        )
    )


def check(cfg: DecodeConfig, m: EarlyExitModel, prompts: list[list[int]] | None = None) -> None:
    """Validate ``cfg`` (and ``prompts``) against the model before any work (the engine too); changes nothing."""
    num_layers = m.num_layers
    if cfg.exit_layer is not None and not 1 <= cfg.exit_layer <= num_layers - 1:
        raise ConfigError(
            f"decoder.exit_layer={cfg.exit_layer} but the model has {num_layers} layers: the exit must leave "
            f"at least one layer to verify with; use 1 <= exit_layer <= {num_layers - 1}."
        )
    if prompts is None:
        return
    if not prompts:
        raise ConfigError("no prompts given: pass a list of token-id lists.")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ConfigError(f"prompt {i} is empty: every row needs at least one token (e.g. BOS).")
        check_context(m.config.max_position_embeddings, cfg.max_new_tokens, len(prompt), f"prompt {i}")
        if min(prompt) < 0 or max(prompt) >= m.vocab_size:
            raise ConfigError(f"prompt {i} has token ids outside the vocabulary [0, {m.vocab_size}).")


def check_context(context: int, max_new_tokens: int, tokens: int, prompt: str, whose: str = "model") -> None:
    """``prompt`` (``tokens`` long) and ``max_new_tokens`` new tokens must fit the ``whose``'s ``context``."""
    if max_new_tokens >= context:  # no prompt fits, whatever its length
        raise ConfigError(
            f"max_new_tokens={max_new_tokens} exceeds the {whose}'s context of {context} positions "
            f"(max_position_embeddings), which holds the prompt too: use max_new_tokens <= {context - 1}."
        )
    if tokens + max_new_tokens > context:
        raise ConfigError(
            f"{prompt} has {tokens} tokens but the {whose}'s context (max_position_embeddings) is {context} and "
            f"max_new_tokens={max_new_tokens}: prompts may have at most {context - max_new_tokens} tokens; "
            "shorten the prompt or lower max_new_tokens."
        )


def refuse_exit_layer(name: str, cfg: DecodeConfig, hint: str = "") -> None:
    """The decoders that draft from a row's text verify with the whole model: no exit layer."""
    if cfg.exit_layer is not None:
        raise ConfigError(
            f"decoder '{name}' verifies with the whole model: set decoder.exit_layer=null (got "
            f"{cfg.exit_layer}){hint}."
        )


def refuse_draft_model(name: str, draft: EarlyExitModel | None) -> None:
    if draft is not None:
        raise ConfigError(
            f"decoder '{name}' uses no separate draft model; pass draft=None (or use 'assisted')."
        )


# --------------------------------------------------------------------------------------------------------
# Prompt batching
@dataclass
class Prefill:
    """A prompt batch after its prefill: the cache holds every prompt token (left-padded, slots [0, W))."""

    cache: KVCache
    positions: torch.Tensor  # [B] long: position of each row's next token (= its prompt length)
    logits: torch.Tensor  # [B, V]: logits after each row's last prompt token


def left_pad(
    prompts: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``prompts`` left-padded into one batch on ``device``: ids ``[B, W]`` (pad id 0: any id works, padding
    is masked), validity ``[B, W]`` (bool, False on padding) and positions ``[B, W]`` (``0..len-1`` per row)."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(batch, width, dtype=torch.long)
    valid = torch.zeros(batch, width, dtype=torch.bool)
    positions = torch.zeros(batch, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        valid[row, width - len(prompt) :] = True
        positions[row, width - len(prompt) :] = torch.arange(len(prompt))
    return ids.to(device), valid.to(device), positions.to(device)


def prefill(
    m: EarlyExitModel,
    prompts: list[list[int]],
    capacity: int,
    *,
    exit_layer: int | None = None,
    adapter: torch.nn.Module | None = None,
) -> Prefill:
    """Left-pad ``prompts`` into one batch and run them through layers ``[0, exit_layer)`` (all by default).

    Padding slots are invalid in ``cache.key_valid``; real tokens take positions ``0..len-1`` per row. With an
    exit ``adapter`` (``fastdecode/drafters/exits/adapter.py``) the cache gets its extra layer slot, and the prompt's
    hidden states at its exit also pass the adapter, which fills that slot.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token (got an empty prompt or no prompts).")
    ids, valid, positions = left_pad(prompts, m.device)
    batch, width = ids.shape
    cache = m.new_cache(batch, max(capacity, width), extra_layers=0 if adapter is None else 1)
    cache.reserve(valid, 0, positions)
    hidden, depth = m.embed(ids, positions), exit_layer or m.num_layers
    if adapter is not None:
        hidden = m.run_layers(hidden, 0, adapter.exit_layer, positions, cache=cache)
        adapter(m, hidden, positions, cache=cache)
        hidden = m.run_layers(hidden, adapter.exit_layer, depth, positions, cache=cache)
    else:
        hidden = m.run_layers(hidden, 0, depth, positions, cache=cache)
    lengths = torch.tensor([len(p) for p in prompts], device=m.device)
    return Prefill(cache, lengths, m.exit_logits(hidden[:, -1]))


# --------------------------------------------------------------------------------------------------------
# Logits processing (identical for drafter and verifier, as lossless speculative sampling requires)
def probabilities(logits: torch.Tensor, cfg: DecodeConfig) -> torch.Tensor:
    """``[..., V]`` logits -> fp32 probabilities after temperature, top-k, top-p (HF's order).

    Greedy (temperature 0): the plain softmax, used only as a confidence signal.
    """
    logits = logits.float()
    if cfg.greedy:
        return logits.softmax(-1)
    logits = logits / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already cover top_p (the top token always stays).
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs > cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of ``probs [..., V]`` -> ``[...]`` long."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def choose(logits: torch.Tensor, probs: torch.Tensor | None, cfg: DecodeConfig, generator) -> torch.Tensor:
    """Next tokens ``[...]``: argmax of the raw logits (greedy, as HF does) or a draw from ``probs``."""
    if cfg.greedy:
        return logits.argmax(-1)
    return sample(probs if probs is not None else probabilities(logits, cfg), generator)


def new_generator(cfg: DecodeConfig, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(cfg.seed)


# --------------------------------------------------------------------------------------------------------
# Per-row bookkeeping on the host
# The callback of ``streaming``: every decoder emits through ``Rows``, so one hook streams them all, and the
# one decoding signature stays free of a callable that no config can hold.
_ON_EMIT: contextvars.ContextVar[Callable[[int, list[int]], None] | None] = contextvars.ContextVar(
    "fastdecode_on_emit", default=None
)


@contextlib.contextmanager
def streaming(on_emit: Callable[[int, list[int]], None]) -> Iterator[None]:
    """Within the block, decoders call ``on_emit(row, new_tokens)`` as tokens are accepted (one token per
    step for autoregressive decoding, the accepted run of each verification for speculative decoding)."""
    token = _ON_EMIT.set(on_emit)
    try:
        yield
    finally:
        _ON_EMIT.reset(token)


class Rows:
    """The tokens emitted so far per row, with EOS and the ``max_new_tokens`` budget applied."""

    def __init__(self, batch: int, cfg: DecodeConfig) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.finished = [False] * batch
        self.budget = cfg.max_new_tokens
        self.eos = cfg.eos_ids
        self.on_emit = _ON_EMIT.get()

    def emit(self, row: int, new: list[int]) -> int:
        """Append ``new`` to ``row`` up to its first EOS (kept) and its budget, then mark it finished.
        Returns how many tokens were appended."""
        out = self.tokens[row]
        before = len(out)
        for token in new[: self.budget - before]:
            out.append(token)
            if token in self.eos:
                self.finished[row] = True
                break
        if len(out) >= self.budget:
            self.finished[row] = True
        if self.on_emit is not None and len(out) > before:
            self.on_emit(row, out[before:])
        return len(out) - before

    def emit_tokens(self, tokens: torch.Tensor) -> None:
        """One new token per row from ``tokens [B]`` (ignored for finished rows). Copies them to the host:
        the one sync per step that one-token-per-step decoders need, since EOS decides the loop."""
        for row, token in enumerate(tokens.tolist()):
            if not self.finished[row]:
                self.emit(row, [token])

    @property
    def active(self) -> list[int]:
        return [row for row, done in enumerate(self.finished) if not done]

    def active_mask(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([not done for done in self.finished], device=device)

    def most_remaining(self) -> int:
        return max(self.budget - len(self.tokens[row]) for row in self.active)
