"""The chain: a first stage drafts from a row's text, and a chainable drafter drafts where it finds nothing.

``FirstStage`` is what a first stage offers (prompt lookup, ``fastdecode/drafters/lookup/ngram.py``, or
suffix decoding with ``decoder.suffix.first``, ``fastdecode/drafters/suffix/proposer.py``). ``ChainProposer``
runs one before a chainable proposer (``fastdecode.decoding.kinds.ProposerKind.chainable``: the exit, the
exit adapter, a draft model, an EAGLE-3 head) and retires that fallback where it stops paying; ``Books``
keeps its judge's counts, which ``carrying`` carries from call to call. Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.proposers import Proposer, one_hot
from fastdecode.decoding.speculative import Draft, Round, Verdict

CARRY = 0.75  # the weight earlier calls' evidence keeps at each new call (``Books.carried``)


@dataclass
class Books:
    """A chain judge's books on its fallback: the row-rounds it drafted, the tokens they yielded (accepted +
    the verifier's own) and the plain decoding steps they cost (``round_cost``, and its ``ride_cost`` in the
    lookup's rows)."""

    judged: float = 0.0
    gained: float = 0.0
    spent: float = 0.0

    def against(self, judge_after: int) -> bool:
        """Enough row-rounds booked, and they yielded fewer tokens than the plain steps they cost."""
        return self.judged >= judge_after and self.gained < self.spent

    def carried(self) -> Books:
        """These books as a new call starts from them: every count weighted by ``CARRY`` (in place: the
        books go on being kept in this object)."""
        self.judged, self.gained, self.spent = (CARRY * x for x in (self.judged, self.gained, self.spent))
        return self


_CARRIED: contextvars.ContextVar[Books | None] = contextvars.ContextVar(
    "fastdecode_chain_books", default=None
)


@contextlib.contextmanager
def carrying(books: Books) -> Iterator[None]:
    """Within the block, a chain built for a call keeps its judge's books in ``books`` (and starts from what
    they hold): the memory ``generate(method="auto")`` keeps per planned chain."""
    token = _CARRIED.set(books)
    try:
        yield
    finally:
        _CARRIED.reset(token)


def carried_books() -> Books | None:
    """The books a chain built now carries on (``carrying``), or None: a call of its own."""
    return _CARRIED.get()


def as_run(name: str, retired: int | None) -> str:
    """``name`` (a decoder, a planned chain) as it ran, given when its chain's fallback was retired
    (``DecodeOutput.fallback_retired``: None, never; 0, from the start: the first stage drafted alone)."""
    if retired is None:
        return name
    if retired == 0:
        return f"{name}, its fallback retired from the start (earlier calls' books): the first stage alone"
    return f"{name}, its fallback retired after round {retired}"


class FirstStage(Proposer):
    """A chain's first stage: deterministic drafts from text. ``lookup(r)``: per row the tokens to draft this
    round (empty: none; rows that no longer decode draft nothing); ``learn(done)``: book how its drafts of the
    round fared (``speculative.Settled``). Its ``name`` labels its rows (``Draft.sources``); ``trial``: the
    row-rounds the chain's fallback drafts before it must have paid for itself (0: never retired)."""

    cfg: DecodeConfig
    vocab_size: int
    trial: int

    def lookup(self, r: Round) -> list[list[int]]:
        raise NotImplementedError

    def learn(self, done) -> None:
        raise NotImplementedError

    def pad(self, drafts: list[list[int]], device: torch.device) -> torch.Tensor:
        """``[B, k]`` drafted ids (k = the longest draft; shorter rows padded with their last token)."""
        k = max((len(d) for d in drafts), default=0)
        rows = [d + [d[-1] if d else 0] * (k - len(d)) for d in drafts]
        return torch.tensor(rows, dtype=torch.long, device=device).reshape(len(drafts), k)

    def propose_found(
        self, drafts: list[list[int]], device: torch.device, parents: list[list[int]] | None = None
    ) -> Draft:
        """The draft of the rows' ``drafts`` (deterministic: q one-hot when sampling); with ``parents`` (per
        row, each node's parent among its drafts) a token tree, the padding hanging off t (parent -1)."""
        tokens = self.pad(drafts, device)
        probs = None if self.cfg.greedy else one_hot(tokens, self.vocab_size)
        found = Draft(tokens, probs, [len(d) for d in drafts], sources=[self.name] * len(drafts))
        if parents is not None:
            k = tokens.shape[1]
            rows = [row + [-1] * (k - len(row)) for row in parents]
            found.parents = torch.tensor(rows, dtype=torch.long, device=device).reshape(len(drafts), k)
        return found


class ChainProposer(Proposer):
    """``lookup`` first, per row (a ``FirstStage``: prompt lookup, or suffix decoding); ``fallback`` (any
    chainable proposer: the exit, the exit adapter, a draft model, an EAGLE-3 head,
    ``kinds.ProposerKind.chainable``) where the lookup finds nothing.

    The fallback drafts only while it pays on this call's text: once it has drafted ``judge_after`` row-rounds
    and the tokens those rounds yielded (accepted + the verifier's own) fall short of the plain decoding steps
    they cost (``round_cost``, ``fastdecode/plan/cost.py``; a plain step is what prompt lookup alone takes there;
    plus what keeping up costs it in the lookup's rows, ``Proposer.ride_cost``: an EAGLE-3 head's rows),
    it is retired for the rest of the call. Rows the lookup does not match then take a plain step: through the
    drafter's layers when they are the target's own (self-speculation: that is part of the verification),
    without the fallback at all when it keeps a cache of its own (a separate draft model stops running). A
    recorded acceptance measured on other text can overstate it (a drafter trained on chat, asked to rewrite
    code): this is where the plan meets the text. ``judge_after=0``: never retired.

    ``books``: the judge's books carried over from earlier calls (``carrying``; ``generate(method="auto")``
    keeps one per planned chain): each call starts from them, their weight decayed (``Books.carried``), so a
    fallback that did not pay on this workload starts retired and is tried again for a few rounds once the
    old evidence has faded, and one that pays drafts from the first round.

    The draft-length policy learns from the fallback's own rows only (``feedback``): a lookup draft's
    acceptance says nothing about the fallback's confidence.
    """

    def __init__(
        self,
        lookup: FirstStage,
        fallback: Proposer,
        *,
        judge_after: int = 16,
        books: Books | None = None,
    ) -> None:
        self.lookup, self.fallback = lookup, fallback
        self.name = f"{lookup.name}+{fallback.name}"
        self.costs, self.vocab = fallback.costs, fallback.vocab
        self.feature_layers = fallback.feature_layers  # the verification hands them to the fallback
        self.judge_after = judge_after
        self.books = Books() if books is None else books.carried()
        self.retired = False
        self.rounds = 0  # rounds settled so far this call
        self.retired_at: int | None = None  # the rounds settled when it was retired (0: at the start)
        if judge_after and self.books.against(judge_after):  # earlier calls' evidence: it does not pay
            self.retire()

    def retire(self) -> None:
        self.retired, self.retired_at = True, self.rounds
        self.fallback.retire()

    def start(self, m, prompts, capacity):
        return self.fallback.start(m, prompts, capacity)

    def token_cost(self) -> float:
        return self.fallback.token_cost()

    def round_cost(self, drafted: int) -> float:
        return self.fallback.round_cost(drafted)

    def caches(self):
        return [] if self.retired else self.fallback.caches()

    def propose(self, r: Round) -> Draft:
        self.lookup.policy = self.fallback.policy = self.policy
        drafts = self.lookup.lookup(r)
        lengths = [len(d) for d in drafts]
        live = r.active.tolist()
        matched = [bool(n) for n, on in zip(lengths, live, strict=True) if on]
        if self.retired and self.fallback.caches():  # a retired separate drafter: prompt lookup alone
            return self.lookup.propose_found(drafts, r.last.device)
        if self.retired or (matched and all(matched)):  # one forward through the drafter's layers
            return self.fallback.absorb(r, self.lookup.pad(drafts, r.last.device), lengths, self.lookup.name)
        if not any(matched):
            draft = self.fallback.draft(r)
            draft.sources = [self.fallback.name] * len(lengths)
            return draft
        return self.fallback.draft(r, (self.lookup.pad(drafts, r.last.device), lengths), self.lookup.name)

    def feedback(self, done) -> tuple[list[int | None], list[int | None]]:
        mine = [source == self.fallback.name for source in done.sources]
        return (
            [a if own else None for a, own in zip(done.accepted, mine, strict=True)],
            [d if own else None for d, own in zip(done.lengths, mine, strict=True)],
        )

    def finish(self, out) -> None:
        """The first stage's ``finish``; ``out.fallback_retired``: when the fallback was retired (None: never)."""
        out.fallback_retired = self.retired_at
        self.lookup.finish(out)

    def update(self, r: Round, draft: Draft, verdict: Verdict, done) -> None:
        self.rounds += 1
        self.lookup.learn(done)
        self.fallback.update(r, draft, verdict, done)
        if self.judge_after and not self.retired:
            self.judge(draft, done)

    def judge(self, draft: Draft, done) -> None:
        """Book the fallback's rows of the round; retire it once it yields fewer tokens than it costs."""
        books = self.books
        for source, accepted, drafted in zip(draft.sources, done.accepted, draft.row_lengths(), strict=True):
            if accepted is None:
                continue
            if source == self.fallback.name:
                books.judged += 1
                books.gained += accepted + 1
                books.spent += self.fallback.round_cost(drafted)
            else:  # the lookup's row: the fallback adds nothing there but what it costs to keep up
                books.spent += self.fallback.ride_cost()
        if books.against(self.judge_after):
            self.retire()
