"""How to decode and what a call returned: ``DecodeConfig``, ``DecodeOutput``, and the option groups.

``DecodeConfig`` holds what every decoder reads; a drafter's own options are a ``DrafterOptions`` dataclass in
its package, registered by its group name when the class is defined and carried in ``DecodeConfig.groups``
(``decoder.<group>.*`` in configs and overrides, ``<group>=`` in ``generate``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from typing import Any, ClassVar, TypeVar

from fastdecode.config import ConfigError, to_dataclass, unknown_name_error
from fastdecode.decoding.policies import POLICIES
from fastdecode.jacobi import JacobiOptions
from fastdecode.plan.cost import SOURCES as COST_SOURCES
from fastdecode.runtime.fast_linear import KERNELS
from fastdecode.runtime.weights import WEIGHTS
from fastdecode.skipdecode import SkipOptions

OptionsT = TypeVar("OptionsT", bound="DrafterOptions")

# group name -> its options class; filled as each drafter's options class is defined (``DrafterOptions``)
OPTION_GROUPS: dict[str, type[DrafterOptions]] = {}


class DrafterOptions:
    """Base of a drafter's option group, a dataclass declared ``class XOptions(DrafterOptions, group="x")``:
    ``decoder.x.*``. ``of(cfg)``: the call's options (the defaults when not given); ``check_call``: the
    checks against the model and the call that every decoder runs, before any work, when the group is given."""

    group: ClassVar[str]

    def __init_subclass__(cls, group: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.group = group
        OPTION_GROUPS[group] = cls

    @classmethod
    def of(cls: type[OptionsT], cfg: DecodeConfig) -> OptionsT:
        return cfg.groups.get(cls.group) or cls()

    def check_call(self, m: Any, cfg: DecodeConfig, decoder: str) -> None:
        """Refuse what this group cannot do in a call of ``decoder`` (a ``ConfigError``); changes nothing."""


def typed_groups(groups: Any) -> dict[str, DrafterOptions]:
    """``groups`` with each value its group's options (mappings converted strictly); an unknown group is
    refused naming the registered ones."""
    if not isinstance(groups, dict):
        raise ConfigError(f"decoder option groups: expected a mapping of group -> options, got {groups!r}.")
    typed = {}
    for name, value in groups.items():
        if name not in OPTION_GROUPS:
            raise unknown_name_error("decoder option group", name, list(OPTION_GROUPS), f"(decoder.{name})")
        typed[name] = to_dataclass(OPTION_GROUPS[name], value, f"decoder.{name}")
    return typed


def merged_options(base: dict, given: dict) -> dict:
    """``given`` over ``base`` (``DecodeConfig`` fields and option groups: a plan's, a checkpoint's defaults):
    a value replaces base's, except an option group given as a mapping, merged key by key into base's group
    (a mapping or an options object), so ``suffix={"global_size": 0}`` keeps the ``first`` and ``corpus`` a
    plan set. An options object given (``SuffixOptions(...)``) states every field: it replaces the group."""
    out = dict(base)
    for key, value in given.items():
        under = out.get(key)
        if is_dataclass(under) and not isinstance(under, type):
            under = asdict(under)
        out[key] = {**under, **value} if isinstance(value, Mapping) and isinstance(under, Mapping) else value
    return out


@dataclass
class DecodeConfig:
    """How to decode. ``temperature=0`` is greedy; ``exit_layer`` E is the number of blocks the drafter (or a
    pure early exit) runs; ``draft_tokens`` is K for the ``constant`` policy and the largest K for the others.
    ``eos_token_id=None`` never stops early (pass the tokenizer's EOS id(s) to stop at EOS). ``draft_vocab``:
    a draft vocabulary file: the drafter's head scores only those tokens (verification keeps the full head).
    ``adapter``: an exit adapter directory (``self_speculative`` drafts through it); ``drafter``: a trained
    drafter's directory (an EAGLE-3 head). ``chain``: rows draft by a first stage (prompt lookup, or another
    registered one) where it matches, by the decoder's drafter elsewhere. ``skip``, ``jacobi``: those
    decoders' options; ``groups``: the drafters' option groups. ``costs``: the cost model the policies read,
    ``measured`` on the loaded model or ``estimated`` from the weights."""

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
    drafter: str | None = None  # an EAGLE-3 head directory (fastdecode/drafters/eagle3/files.py)
    skip: SkipOptions = field(default_factory=SkipOptions)  # the skipdecode decoder's options
    jacobi: JacobiOptions = field(default_factory=JacobiOptions)  # the jacobi decoder's options
    # a drafter's option groups by name (``decoder.<group>.*``): each drafter declares its own (DrafterOptions)
    groups: dict[str, Any] = field(default_factory=dict)
    chain: bool = False
    costs: str = "measured"

    # execution engine (fastdecode/runtime/engine.py); null = the default for the device (CPU: on; CUDA: off)
    fast_layers: bool | None = None  # lean layers over fused projections (Llama/Mistral/Qwen2 families)
    fast_linear: bool | None = None  # pre-packed CPU kernels for every projection and the LM head
    linear_kernel: str | None = None  # null: per number of rows, by measurement; or linear | mkl | dnn
    static_cache: bool | None = None  # the static-shape cache mode (null: only when compiling)
    compile: bool = False  # torch.compile of each layer range per number of new tokens (static cache)
    # what the products read (fastdecode/runtime/weights.py): auto (a GGUF's 4-bit blocks as shipped where they
    # are exact, on a CPU; else fp32) | fp32 | int4 (shipped where exact, else quantised at load) | int8
    weights: str = "auto"

    def __post_init__(self) -> None:
        self.groups = typed_groups(self.groups)
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
        if self.weights not in WEIGHTS:
            raise unknown_name_error("weights", self.weights, list(WEIGHTS), "(decoder.weights)")
        if self.costs not in COST_SOURCES:
            raise unknown_name_error("cost model", self.costs, list(COST_SOURCES), "(decoder.costs)")
        if self.compile and self.static_cache is False:
            raise ConfigError(
                "decoder.compile=true needs the static cache: set decoder.static_cache=true or null."
            )

    @classmethod
    def open_groups(cls) -> dict[str, type]:
        """The keys besides the fields that ``to_dataclass`` collects into ``groups``: the registered groups."""
        return dict(OPTION_GROUPS)

    def with_options(self, *options: DrafterOptions) -> DecodeConfig:
        """A copy with ``options`` as their groups' values (the other groups kept)."""
        return replace(self, groups={**self.groups, **{o.group: o for o in options}})

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
    ``fallback_retired`` (a chain): the rounds the call had run when the chain's judge retired its fallback,
    0 when it was retired from the start (the books of earlier calls: the first stage drafted alone); None
    when it was not retired, or no chain ran.
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
    fallback_retired: int | None = None  # a chain's fallback retired after this many rounds (0: at the start)
    weights: str | None = None  # what the products read (``Weights.label``), set by every registered decoder

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
                tally[0] += a
                tally[1] += d
                tally[2] += int(d > 0)
        self.oracle += oracle
