"""What every decoding strategy shares: the config, the output record, prompt batching, logits processing.

Every strategy is a free function with one signature (see ``fastdecode/decoding/__init__.py``)::

    generate(m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft=None) -> DecodeOutput

Prompts of a batch are left-padded into one ``[B, W]`` block; padding slots are invalid in the cache's
``key_valid`` mask, and each row counts positions from 0 at its first real token, so a batched row decodes
exactly (bit-identically in fp32) like the same row alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from fastdecode.cache import KVCache
from fastdecode.config import ConfigError, unknown_name_error
from fastdecode.cost import SOURCES as COST_SOURCES
from fastdecode.decoding import options
from fastdecode.decoding.policies import POLICIES
from fastdecode.engine import default_options
from fastdecode.fast_linear import KERNELS
from fastdecode.model import EarlyExitModel


@dataclass
class DecodeConfig:
    """How to decode. ``temperature=0`` is greedy; ``exit_layer`` E is the number of blocks the drafter (or a
    pure early exit) runs; ``draft_tokens`` is K for the ``constant`` policy and the largest K for the others.
    ``eos_token_id=None`` never stops early (pass the tokenizer's EOS id(s) to stop at EOS). ``draft_vocab``:
    path of a draft vocabulary file (``fastdecode/data/draft_vocab.py``); the drafter's head then scores only
    those tokens (verification keeps the full head: still lossless). ``skip``, ``jacobi``, ``suffix``,
    ``eagle3``: the options of those decoders (``fastdecode/decoding/options.py``). ``adapter``: an exit
    adapter directory (``fastdecode/exit_adapter.py``); ``self_speculative`` then drafts through it (E from
    the adapter). ``lookup``: n-gram drafting; ``chain``: ``self_speculative``/``assisted`` rows draft by lookup where it matches.
    ``costs``: the cost model the policies and n-gram drafts read (``fastdecode/cost.py``): ``measured`` on
    the loaded model (once per model and engine) or ``estimated`` from the weights."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    exit_layer: int | None = None
    policy: str = "constant"
    draft_tokens: int = 4
    confidence_threshold: float = 0.4
    eos_token_id: int | list[int] | None = None
    seed: int = 0
    draft_vocab: str | None = None
    adapter: str | None = None
    drafter: str | None = None  # an EAGLE-3 head directory (decoder 'eagle3', fastdecode/eagle3_files.py)
    skip: options.SkipOptions = field(default_factory=options.SkipOptions)  # one decoder's options each
    jacobi: options.JacobiOptions = field(default_factory=options.JacobiOptions)
    lookup: options.LookupOptions = field(default_factory=options.LookupOptions)
    suffix: options.SuffixOptions = field(default_factory=options.SuffixOptions)
    eagle3: options.Eagle3Options = field(default_factory=options.Eagle3Options)
    chain: bool = False
    costs: str = "measured"

    # execution engine (fastdecode/engine.py); null = the default for the device (CPU: on; CUDA: off)
    fast_layers: bool | None = None  # lean layers over fused projections (Llama/Mistral/Qwen2 families)
    fast_linear: bool | None = None  # pre-packed CPU kernels for every projection and the LM head
    linear_kernel: str | None = None  # null: per number of rows, by measurement; or linear | mkl | dnn
    static_cache: bool | None = None  # the static-shape cache mode (null: only when compiling)
    compile: bool = False  # torch.compile of each layer range per number of new tokens (static cache)

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ConfigError(f"decoder.max_new_tokens={self.max_new_tokens}: must be >= 1.")
        if self.temperature < 0:
            raise ConfigError(f"decoder.temperature={self.temperature}: must be >= 0 (0 = greedy).")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"decoder.top_k={self.top_k}: must be >= 1, or null to disable it.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"decoder.top_p={self.top_p}: must be in (0, 1], or null to disable it.")
        if self.exit_layer is not None and self.exit_layer <= 0:
            raise ConfigError(
                f"decoder.exit_layer={self.exit_layer}: the drafter must run at least one block; "
                "use 1 <= exit_layer <= num_layers - 1 (or null for full depth)."
            )
        if self.draft_tokens < 1:
            raise ConfigError(f"decoder.draft_tokens={self.draft_tokens}: must be >= 1.")
        if not 0 <= self.confidence_threshold <= 1:
            raise ConfigError(f"decoder.confidence_threshold={self.confidence_threshold}: must be in [0, 1].")
        if self.policy not in POLICIES:
            raise unknown_name_error("draft-length policy", self.policy, list(POLICIES), "(decoder.policy)")
        if self.linear_kernel is not None and self.linear_kernel not in KERNELS:
            raise unknown_name_error(
                "linear kernel", self.linear_kernel, list(KERNELS), "(decoder.linear_kernel)"
            )
        if self.costs not in COST_SOURCES:
            raise unknown_name_error("cost model", self.costs, list(COST_SOURCES), "(decoder.costs)")
        if self.compile and self.static_cache is False:
            raise ConfigError(
                "decoder.compile=true needs the static cache: set decoder.static_cache=true or null."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def eos_ids(self) -> set[int]:
        if self.eos_token_id is None:
            return set()
        return {self.eos_token_id} if isinstance(self.eos_token_id, int) else set(self.eos_token_id)


@dataclass
class DecodeOutput:
    """Result of one ``generate`` call.

    ``tokens``: new tokens per row, EOS included once and nothing after it. ``steps``: decoding iterations
    after the prefill (one model pass for autoregressive, one draft + verify round for speculative).
    ``accepted``/``drafted``/``oracle``: one entry per verification and active row; ``oracle`` is the number
    of leading drafted tokens equal to the verifier's argmax (the best draft length, when the policy drafts
    the full K: run ``policy=constant`` with a large ``draft_tokens`` to measure it).
    ``position_accepted[i]``/``position_drafted[i]``: how often draft position i+1 was accepted / drafted.
    ``layers_run``: decoder-layer x token applications after the prefill, counted for active rows (compute).
    ``layer_calls``: decoder-layer forward calls after the prefill, each over the whole batch and any number
    of positions: the latency proxy when decoding is memory-bound (self-speculation lowers this one).
    ``fast_forward`` (jacobi): tokens fixed per forward and row; ``stationary``: per converged block and row.
    ``by_proposer``: per proposer of a chain, accepted and drafted tokens and the row rounds it drafted in.
    """

    tokens: list[list[int]]
    steps: int = 0
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    oracle: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    position_drafted: list[int] = field(default_factory=list)
    layers_run: int = 0
    layer_calls: int = 0
    fast_forward: list[int] = field(default_factory=list)
    stationary: list[int] = field(default_factory=list)
    by_proposer: dict[str, list[int]] = field(default_factory=dict)  # name -> [accepted, drafted, rounds]

    @property
    def num_tokens(self) -> int:
        return sum(len(row) for row in self.tokens)

    @property
    def acceptance_rate(self) -> float:
        return sum(self.accepted) / max(1, sum(self.drafted))

    @property
    def layers_per_token(self) -> float:
        return self.layers_run / max(1, self.num_tokens)

    @property
    def layer_calls_per_token(self) -> float:
        """Sequential layer calls per new token of the longest row."""
        return self.layer_calls / max(1, max(len(row) for row in self.tokens))

    def record(
        self, accepted: list[int], drafted: list[int], oracle: list[int], sources: list[str] | None = None
    ) -> None:
        """Book one verification: per decoding row, the accepted drafts, the drafted tokens, the oracle count
        and (a chain of proposers) which proposer drafted."""
        longest = max(drafted, default=0)
        grow = longest - len(self.position_drafted)
        if grow > 0:
            self.position_drafted += [0] * grow
            self.position_accepted += [0] * grow
        for row, (a, d) in enumerate(zip(accepted, drafted, strict=True)):
            self.accepted.append(a)
            self.drafted.append(d)
            for i in range(d):
                self.position_drafted[i] += 1
                self.position_accepted[i] += int(i < a)
            if sources is not None and sources[row] is not None:
                tally = self.by_proposer.setdefault(sources[row], [0, 0, 0])
                tally[0], tally[1], tally[2] = tally[0] + a, tally[1] + d, tally[2] + int(d > 0)
        self.oracle += oracle


def configure_engine(m: EarlyExitModel, cfg: DecodeConfig) -> None:
    """Select the model's execution engine for this call from ``cfg`` (``fastdecode/engine.py``): every decoder
    calls it after its checks, before any work (the cost model measures the engine that decodes)."""
    m.use_engine(
        default_options(
            m.device,
            fast_layers=cfg.fast_layers,
            fast_linear=cfg.fast_linear,
            kernel=cfg.linear_kernel,
            static_cache=cfg.static_cache,
            compile=cfg.compile,
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
    exit ``adapter`` (``fastdecode/exit_adapter.py``) the cache gets its extra layer slot, and the prompt's
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
