"""Prompt lookup's n-gram drafts: looked up in the text a row already holds, free to make.

``NgramIndex`` keeps one row's tokens and one occurrence per n-gram. ``PromptLookupProposer`` drafts the
continuation of an earlier occurrence of the row's last n tokens (n from ``decoder.lookup.max_ngram_size``
down to ``min_ngram_size``), cut at an EOS (``decoder.lookup.eos``); with a cost-aware policy it cuts the
batch's drafts at the width the cost model expects to pay best (``cut``, from ``AcceptanceStats``). A row
with no match drafts nothing. It is also a chain's default first stage. Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastdecode.decoding.chain import FirstStage
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.speculative import Draft, Round, Verdict
from fastdecode.drafters.lookup.options import EOS_CUTS, MATCHES, LookupOptions
from fastdecode.plan.acceptance import MATCH_PRIOR, MATCH_PRIOR_WEIGHT
from fastdecode.plan.cost import CostModel, expected_tokens


class NgramIndex:
    """One row's tokens with, per n, the start of one occurrence of every n-gram that has a continuation (so a
    lookup never finds the row's own last n tokens): the most recent (``match="recent"``) or the first
    (``"earliest"``), kept as the tokens arrive, so a lookup costs one dict access per n. How this differs
    from transformers' and vLLM's lookups: docs/design/drafters.md.

    ``stop``: the EOS ids. ``eos="before"`` (transformers): a continuation ends before its first EOS (one that
    starts with it drafts nothing); ``"after"``: the EOS is drafted and ends it. Never past an EOS: a row stops
    there, so tokens after it could not count (vLLM drafts on)."""

    def __init__(
        self, max_n: int, *, match: str = "recent", stop: Iterable[int] = (), eos: str = "before"
    ) -> None:
        if match not in MATCHES or eos not in EOS_CUTS:
            raise ValueError(f"match={match!r}, eos={eos!r}: need one of {MATCHES} and one of {EOS_CUTS}")
        self.tokens: list[int] = []
        self.max_n = max_n
        self.earliest = match == "earliest"
        self.stop = frozenset(stop)
        self.before = eos == "before"
        self.starts: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]

    def extend(self, new: list[int]) -> None:
        tokens = self.tokens
        for token in new:
            end = len(tokens)  # the n-grams ending at end - 1 now have a continuation: ``token``
            for n in range(1, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n : end])
                if self.earliest:
                    self.starts[n].setdefault(key, end - n)
                else:
                    self.starts[n][key] = end - n
            tokens.append(token)

    def lookup(self, min_n: int, limit: int) -> tuple[list[int], int]:
        """``(continuation of at most limit tokens, n)`` of the longest matching suffix; ``([], 0)`` if none.
        The continuation never runs past the row's current end, nor past an EOS (see the class docstring)."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens) - 1), min_n - 1, -1):
            start = self.starts[n].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return self.cut(tokens[start + n : start + n + limit]), n
        return [], 0

    def cut(self, found: list[int]) -> list[int]:
        """``found`` ended before its first EOS (``eos="before"``) or after it (``"after"``)."""
        cut = next((i for i, t in enumerate(found) if t in self.stop), None)
        if cut is not None:
            found = found[: cut if self.before else cut + 1]
        return found


def new_index(options: LookupOptions, eos_ids: Iterable[int]) -> NgramIndex:
    """An empty ``NgramIndex`` as ``decoder.lookup`` (``options``) sets it up, stopping at ``eos_ids``."""
    return NgramIndex(options.max_ngram_size, match=options.match, stop=eos_ids, eos=options.eos)


class AcceptanceStats:
    """Conditional acceptance per (match length n, draft position i): counts over ``MATCH_PRIOR``."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, int], list[int]] = {}

    def estimate(self, n: int, length: int) -> list[float]:
        prior = MATCH_PRIOR.get(n, MATCH_PRIOR[max(MATCH_PRIOR)])
        found = []
        for i in range(length):
            accepted, tried = self.counts.get((n, i), [0, 0])
            mean = prior[min(i, len(prior) - 1)]
            found.append((accepted + mean * MATCH_PRIOR_WEIGHT) / (tried + MATCH_PRIOR_WEIGHT))
        return found

    def add(self, n: int, accepted: int, drafted: int) -> None:
        for i in range(min(accepted + 1, drafted)):  # the accepted ones and the first rejected one
            tally = self.counts.setdefault((n, i), [0, 0])
            tally[0] += int(i < accepted)
            tally[1] += 1


class PromptLookupProposer(FirstStage):
    """Prompt lookup over each row's prompt and output (``decoder.lookup``); see the module docstring."""

    name = "prompt_lookup"

    def __init__(
        self, prompts: list[list[int]], cfg: DecodeConfig, costs: CostModel, vocab_size: int
    ) -> None:
        self.cfg, self.costs, self.vocab_size = cfg, costs, vocab_size
        self.options = LookupOptions.of(cfg)
        self.trial = self.options.fallback_trial
        self.prompts = prompts
        self.indexes = [new_index(self.options, cfg.eos_ids) for _ in prompts]
        self.stats = AcceptanceStats()
        self.lengths: list[int] = [0] * len(prompts)  # each row's last lookup draft (0: none)
        self.matched: list[int] = [0] * len(prompts)  # and the length n of its match

    def _sync(self, row: int, generated: list[int]) -> NgramIndex:
        index = self.indexes[row]
        context = len(self.prompts[row]) + len(generated)
        if len(index.tokens) < context:
            full = self.prompts[row] + generated
            index.extend(full[len(index.tokens) :])
        return index

    def _row(self, r: Round, row: int) -> tuple[list[int], int]:
        """The row's lookup: at most ``r.limit`` tokens, cut at an EOS as ``decoder.lookup.eos`` says (the
        index does); ``([], 0)`` when not decoding."""
        if r.rows.finished[row] or r.limit <= 0:
            return [], 0
        found, n = self._sync(row, r.rows.tokens[row]).lookup(self.options.min_ngram_size, r.limit)
        return found, n if found else 0

    def cut(self, found: list[tuple[list[int], int]]) -> int:
        """The draft width where the batch's expected tokens per cost is highest: a verification is as wide
        as the longest draft, so every row's draft is cut at one width W. Expected tokens per row from the
        acceptance seen so far (``AcceptanceStats``), cost from the cost model at this batch size."""
        rows = [self.stats.estimate(n, len(tokens)) for tokens, n in found if tokens]
        if not rows:
            return 0
        plain = len(found)  # a plain step: one token per decoding row
        best, best_rate = 0, plain / self.costs.verify(1)
        for width in range(1, max(len(row) for row in rows) + 1):
            tokens = plain + sum(expected_tokens(row[:width]) - 1 for row in rows)
            rate = tokens / self.costs.verify(width + 1)
            if rate > best_rate:
                best, best_rate = width, rate
        return best

    def lookup(self, r: Round) -> list[list[int]]:
        """Per row the tokens to draft: cut after an EOS, at the limit and, with a cost-aware policy, at the
        width the cost model expects to pay best for the batch (``cut``). Rows that no longer decode draft
        nothing."""
        found = [self._row(r, row) for row in range(len(r.rows.tokens))]
        if self.policy.cost_aware:
            width = self.cut([item for row, item in enumerate(found) if not r.rows.finished[row]])
            found = [(tokens[:width], n if tokens[:width] else 0) for tokens, n in found]
        self.lengths = [len(tokens) for tokens, _ in found]
        self.matched = [n for _, n in found]
        return [tokens for tokens, _ in found]

    def propose(self, r: Round) -> Draft:
        return self.propose_found(self.lookup(r), r.last.device)

    def learn(self, done) -> None:
        """Book the acceptance of this proposer's drafts of the round (``speculative.Settled``)."""
        for row, (n, drafted) in enumerate(zip(self.matched, self.lengths, strict=True)):
            if n and done.accepted[row] is not None:  # a chain's row drafts its own tokens after the lookup's
                self.stats.add(n, min(done.accepted[row], drafted), drafted)

    def update(self, r: Round, draft: Draft, verdict: Verdict, done) -> None:
        self.learn(done)
