"""Suffix decoding (SuffixDecoding, Oliaro et al., NeurIPS 2025): the ``suffix`` decoder. Drafts continue the
longest suffix of a row's text found in a suffix index (``index.py``), verified by the whole model: lossless.

``SuffixProposer`` drafts per row from the best of its indexes (the row's own, the process-wide global one,
an optional corpus file: ``sources.py``) by expected accepted length under ``Calibration``: a chain, or a
token tree with ``decoder.suffix.tree=true``, cut with a cost-aware policy at the batch's best width. With
``decoder.suffix.first`` it is a chain's first stage. Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from fastdecode.decoding.chain import CARRY, FirstStage
from fastdecode.decoding.common import refuse_exit_layer
from fastdecode.decoding.config import DecodeConfig, DecodeOutput
from fastdecode.decoding.kinds import ProposerKind, Setup
from fastdecode.decoding.speculative import Draft, Round, Verdict
from fastdecode.decoding.tree import row_depths
from fastdecode.drafters.suffix.index import SuffixDraft, SuffixIndex
from fastdecode.drafters.suffix.options import SuffixOptions
from fastdecode.drafters.suffix.sources import carried, corpus_of, global_index, remember
from fastdecode.files.file_cache import file_identity
from fastdecode.plan.acceptance import MATCH_PRIOR
from fastdecode.plan.cost import best_node_budget
from fastdecode.runtime.model import EarlyExitModel

MATCH_PRIOR_WEIGHT = 4.0
MATCH_BINS = (1, 2, 3, 4, 8, 16)  # match-length buckets: [1], [2], [3], [4, 8), [8, 16), [16, ...)
RATIO_BINS = 4  # frequency-ratio buckets: [0, .25), ..., [.75, 1), and 1 itself


def bin_of(source: str, match: int, ratio: float) -> tuple[str, int, int]:
    return source, sum(match >= b for b in MATCH_BINS), min(int(ratio * RATIO_BINS), RATIO_BINS)


class Calibration:
    """Acceptance of a drafted node given its parent was accepted, per bin (``bin_of``), over a prior. Shared
    by the calls on a model that draft the same shape over the same corpus (``carried_calibration``): ``lock``
    guards its updates."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int, int], list[float]] = {}
        self.lock = threading.Lock()

    def carried(self) -> Calibration:
        """These counts as a new call starts from them, each weighted by ``CARRY`` (in place): what earlier
        calls of the process learnt, fading as this call's own evidence arrives."""
        with self.lock:
            for tally in self.counts.values():
                tally[0], tally[1] = CARRY * tally[0], CARRY * tally[1]
        return self

    def ratio(self, source: str, match: int, ratio: float) -> float:
        prior = ratio * MATCH_PRIOR.get(min(match, max(MATCH_PRIOR)), MATCH_PRIOR[max(MATCH_PRIOR)])[0]
        accepted, tried = self.counts.get(bin_of(source, match, ratio), (0.0, 0.0))
        return (accepted + prior * MATCH_PRIOR_WEIGHT) / (tried + MATCH_PRIOR_WEIGHT)

    def scores(self, source: str, draft: SuffixDraft) -> list[float]:
        """Each node's calibrated probability of being accepted (its path's calibrated ratios multiplied)."""
        out: list[float] = []
        for prob, parent, depth in zip(draft.probs, draft.parents, row_depths(draft.parents), strict=True):
            step = self.ratio(source, draft.match_length + depth - 1, prob)
            out.append(step * (out[parent] if parent >= 0 else 1.0))
        return out

    def learn(self, source: str, draft: SuffixDraft, emitted: list[int]) -> None:
        """Book a verified draft: a node was tried if its parent was accepted (the root always is), accepted if
        it lies on the path the ``emitted`` tokens (this round's, verifier's token included) walk."""
        accepted = {-1}
        node = -1
        for token in emitted:
            node = next(
                (i for i, p in enumerate(draft.parents) if p == node and draft.tokens[i] == token), None
            )
            if node is None:
                break
            accepted.add(node)
        for i, (prob, parent, depth) in enumerate(
            zip(draft.probs, draft.parents, row_depths(draft.parents), strict=True)
        ):
            if parent in accepted:
                with self.lock:
                    tally = self.counts.setdefault(
                        bin_of(source, draft.match_length + depth - 1, prob), [0.0, 0.0]
                    )
                    tally[0] += i in accepted
                    tally[1] += 1


def carried_calibration(m: EarlyExitModel, options: SuffixOptions) -> Calibration:
    """The calibration that calls on ``m`` with these options carry on (``sources.carried``), one per draft
    shape and corpus file version (None: no corpus): acceptance per bin depends on both (a tree's second
    child is tried where a chain never drafts one; another corpus drafts other continuations). A chain's
    first stage drafts the chains suffix decoding alone does, verified alike: it shares theirs."""
    corpus = None if options.corpus is None else file_identity([options.corpus])
    return carried(m, ("calibration", "tree" if options.tree else "chain", corpus), Calibration)


@dataclass
class SuffixChoice:
    """One row's draft this round: which index it came from, the draft, its nodes' calibrated scores."""

    source: str
    draft: SuffixDraft
    scores: list[float]


def cut(draft: SuffixDraft, width: int) -> SuffixDraft:
    """The first ``width`` nodes (parents come before their children: still a chain or a tree)."""
    return SuffixDraft(
        draft.tokens[:width],
        draft.parents[:width],
        draft.probs[:width],
        draft.scores[:width],
        draft.match_length,
    )


class SuffixProposer(FirstStage):
    """Suffix decoding's drafts (see the module docstring); a chain's first stage too (``lookup``, ``learn``:
    ``decoder.suffix.first``)."""

    name = "suffix"

    def __init__(self, s: Setup, trial: int = 0) -> None:
        self.m, self.cfg, self.costs, self.vocab_size = s.m, s.cfg, s.costs, s.m.vocab_size
        self.trial = trial  # as a chain's first stage: the fallback's trial (fastdecode.registry)
        self.options = options = SuffixOptions.of(s.cfg)
        stop = s.cfg.eos_ids
        self.prompts = s.prompts
        self.rows = [SuffixIndex(options.max_depth, stop=stop, eos=options.eos) for _ in s.prompts]
        for row, prompt in enumerate(s.prompts):
            self.rows[row].add(0, prompt)
        self.shared: dict[str, SuffixIndex] = {}
        found = global_index(s.m, options, stop)
        if found is not None:
            self.shared["global"] = found
        corpus = corpus_of(s.m, options, stop)
        if corpus is not None:
            self.shared["corpus"] = corpus
        self.calibration = carried_calibration(s.m, options).carried()
        self.drafted: list[SuffixChoice | None] = [None] * len(s.prompts)
        self.before: list[int] = [0] * len(s.prompts)  # each row's emitted tokens when it drafted
        self.round: Round | None = None  # the round it last drafted in (its rows: the emitted tokens)

    def best_choice(self, row: int, generated: list[int], limit: int) -> SuffixChoice | None:
        """The row's best draft of at most ``limit`` nodes over its indexes, None when none matches."""
        own = self.rows[row]
        context = own.tokens[own.keys[0]]  # the row's text: its prompt, then its output (sequence id 0)
        if len(context) < len(self.prompts[row]) + len(generated):
            own.extend(0, generated[len(context) - len(self.prompts[row]) :])
        best = None
        for source, index in [("row", own), *self.shared.items()]:
            make = index.draft_tree if self.options.tree else index.draft_chain
            draft = make(context, limit, self.options.min_prob)
            if not draft.tokens or draft.match_length < self.options.min_match:
                continue
            found = SuffixChoice(source, draft, self.calibration.scores(source, draft))
            if best is None or sum(found.scores) > sum(best.scores):
                best = found
        return best

    def propose(self, r: Round) -> Draft:
        drafts = [c.draft if c is not None else SuffixDraft() for c in self.choose(r)]
        parents = [d.parents for d in drafts] if self.options.tree else None
        return self.propose_found([d.tokens for d in drafts], r.last.device, parents)

    def lookup(self, r: Round) -> list[list[int]]:
        """As a chain's first stage (``decoder.suffix.first``): per row its chain draft's tokens (empty: none)."""
        return [c.draft.tokens if c is not None else [] for c in self.choose(r)]

    def choose(self, r: Round) -> list[SuffixChoice | None]:
        """Each row's draft this round (None: none), cut with a cost-aware policy at the width the cost model
        expects to pay best for the batch (``cost.best_node_budget``); remembered for ``learn``."""
        batch = len(r.rows.tokens)
        self.round = r
        found: list[SuffixChoice | None] = [None] * batch
        for row in range(batch):
            self.before[row] = len(r.rows.tokens[row])
            if not r.rows.finished[row] and r.limit > 0:
                found[row] = self.best_choice(row, r.rows.tokens[row], r.limit)
        if self.policy.cost_aware:
            plain = sum(not done for done in r.rows.finished)
            width = best_node_budget(self.costs, [c.scores for c in found if c is not None], plain)
            found = [
                None if c is None or width == 0 else SuffixChoice(c.source, cut(c.draft, width), [])
                for c in found
            ]
        self.drafted = found
        return found

    def update(self, r: Round, draft: Draft, verdict: Verdict, done) -> None:
        self.learn(done)

    def finish(self, out: DecodeOutput) -> None:
        """The call's outputs join the global index (alone, or first in a chain)."""
        remember(self.m, self.options, self.cfg.eos_ids, out.tokens)

    def learn(self, done) -> None:
        """Book each drafted row's outcome (``Calibration.learn``) from the tokens it emitted this round."""
        for row, found in enumerate(self.drafted):
            if found is not None and done.accepted[row] is not None:
                emitted = self.round.rows.tokens[row][self.before[row] :]
                self.calibration.learn(found.source, found.draft, emitted)


def check_suffix(m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft=None) -> None:
    """Refuse an exit layer, and a corpus file that is damaged, foreign, for another vocabulary or over
    ``max_corpus_bytes`` (loaded here, once per file version, before any decoding)."""
    refuse_exit_layer("suffix", cfg)
    corpus_of(m, SuffixOptions.of(cfg), cfg.eos_ids)


def build(s: Setup) -> SuffixProposer:
    return SuffixProposer(s)


KIND = ProposerKind("suffix", build, check=check_suffix)
generate = KIND.generate
