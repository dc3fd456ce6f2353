"""Lookahead decoding (Fu et al., 2024): Jacobi iteration harvests n-grams into a pool, and the pool's n-grams
are verified as drafts; the ``lookahead`` decoder, lossless, with no draft model and no training.

``LookaheadProposer`` drafts per row, in order of preference: the prompt-lookup continuation of its text
(``ngram.py``), the pool's newest n-gram that starts with the last accepted token t, or t repeated (Jacobi's
``repeat`` guess). Each verification is at once the Jacobi step that feeds the pool and the check of the
draft. Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

from fastdecode.decoding.common import refuse_exit_layer
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.kinds import ProposerKind, Setup
from fastdecode.decoding.proposers import one_hot
from fastdecode.decoding.speculative import Draft, Round, Verdict
from fastdecode.drafters.lookup.ngram import PromptLookupProposer
from fastdecode.drafters.lookup.options import refuse_tree
from fastdecode.runtime.model import EarlyExitModel


class LookaheadProposer(PromptLookupProposer):
    """Prompt lookup, then the Jacobi pool, then a repeat guess (see the module docstring)."""

    name = "lookahead"

    def __init__(self, prompts, cfg: DecodeConfig, costs, vocab_size: int) -> None:
        super().__init__(prompts, cfg, costs, vocab_size)
        self.pools: list[dict[int, list[int]]] = [{} for _ in prompts]  # per row: first token -> n-gram tail

    def propose(self, r: Round) -> Draft:
        drafts = self.lookup(r)
        last = r.last.tolist()
        for row, found in enumerate(drafts):
            if found or r.rows.finished[row] or r.limit <= 0:
                continue
            guess = self.pools[row].get(last[row], [])[: r.limit]
            drafts[row] = guess + [last[row]] * (r.limit - len(guess))
        tokens = self.pad(drafts, r.last.device)
        probs = None if self.cfg.greedy else one_hot(tokens, self.vocab_size)
        sources = [self.name if self.lengths[row] == 0 else "prompt_lookup" for row in range(len(drafts))]
        return Draft(tokens, probs, [len(d) for d in drafts], sources=sources)

    def update(self, r: Round, draft: Draft, verdict: Verdict, done) -> None:
        self.learn(done)
        target = verdict.target.tolist()  # [B, k+1]: the verifier's argmax at [t, d1..dk]
        width = max(r.limit, 1)
        for row, accepted in enumerate(done.accepted):
            if accepted is None:
                continue
            # the correction (or bonus) token, then the next guesses (up to the row's own draft)
            trajectory = target[row][accepted : done.lengths[row] + 1]
            pool = self.pools[row]
            for i in range(len(trajectory) - 1):
                pool[trajectory[i]] = trajectory[i + 1 : i + 1 + width]


def check_lookahead(m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft=None) -> None:
    refuse_exit_layer("lookahead", cfg)
    refuse_tree("decoder 'lookahead'", cfg)


def build(s: Setup) -> LookaheadProposer:
    return LookaheadProposer(s.prompts, s.cfg, s.costs, s.m.vocab_size)


KIND = ProposerKind("lookahead", build, check=check_lookahead)
generate = KIND.generate
