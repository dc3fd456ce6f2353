"""Prompt lookup replayed over the model's known greedy answers: what each lookup variant drafts, has accepted
and costs, by counting, not timing (``fastdecode-lookup-replay``).

``replay`` runs the ``prompt_lookup`` decoder's own parts with the known answer in place of the model, so its
``DecodeOutput`` is the decoder's, round for round. ``measure`` tallies every variant under every policy and
``report`` writes the tables. Why the replay is exact: docs/design/bench.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from fastdecode.decoding.common import Rows
from fastdecode.decoding.config import DecodeConfig, DecodeOutput
from fastdecode.decoding.speculative import Round, Verdict, new_policy, settle
from fastdecode.drafters.lookup.ngram import PromptLookupProposer
from fastdecode.drafters.lookup.options import LookupOptions
from fastdecode.plan.cost import CostModel

UNKNOWN = -1  # the verifier's token past the known answer: equal to no draft


@dataclass(frozen=True)
class Variant:
    """One prompt lookup: which occurrence (``decoder.lookup.match``), the longest n, where EOS cuts."""

    match: str
    max_n: int
    eos: str

    def config(self, cfg: DecodeConfig) -> DecodeConfig:
        """``cfg`` with this variant's ``decoder.lookup`` (n from ``max_n`` down to 1)."""
        lookup = LookupOptions(max_ngram_size=self.max_n, min_ngram_size=1, match=self.match, eos=self.eos)
        return cfg.with_options(lookup)

    @property
    def label(self) -> str:
        return f"{self.match}, n <= {self.max_n}, EOS {self.eos}"


class Replayed(NamedTuple):
    """One replayed decoder call: its output, the summed cost of its rounds (plain steps), its proposer."""

    out: DecodeOutput
    cost: float
    proposer: PromptLookupProposer


def known_verdict(draft, rows: Rows, answers: Sequence[Sequence[int]]) -> Verdict:
    """The verifier's ruling on ``draft`` (a ``speculative.Draft``) when its argmax is the known answer:
    target ``[B, k+1]`` = each row's next answer tokens, accepted = the greedy prefix match."""
    k = draft.k
    target = []
    for row, answer in enumerate(answers):
        window = list(answer[len(rows.tokens[row]) :][: k + 1])
        target.append(window + [UNKNOWN] * (k + 1 - len(window)))
    target_t = torch.tensor(target, dtype=torch.long).reshape(len(answers), k + 1)
    valid = torch.arange(k)[None, :] < torch.tensor(draft.row_lengths())[:, None]  # [B, k]
    accepted = ((draft.tokens == target_t[:, :k]) & valid).long().cumprod(-1).sum(-1)
    next_token = target_t.gather(1, accepted[:, None])[:, 0]
    return Verdict(accepted, next_token, accepted, target_t)


def check_answers(answers: Sequence[Sequence[int]], cfg: DecodeConfig) -> None:
    """Each answer must say how its row ends: an EOS, or ``cfg.max_new_tokens`` tokens or more."""
    for row, answer in enumerate(answers):
        ends = any(t in cfg.eos_ids for t in answer) or len(answer) >= cfg.max_new_tokens
        if not answer or not ends:
            raise ValueError(
                f"answer {row} ({len(answer)} tokens) neither holds an EOS of {sorted(cfg.eos_ids)} nor "
                f"reaches max_new_tokens={cfg.max_new_tokens}: the replay would run past what is known"
            )


def replay(
    prompts: list[list[int]],
    answers: Sequence[Sequence[int]],
    cfg: DecodeConfig,
    costs: CostModel,
    *,
    vocab_size: int,
    proposer: type[PromptLookupProposer] = PromptLookupProposer,
) -> Replayed:
    """One ``prompt_lookup`` call (greedy ``cfg``) over ``prompts`` whose greedy answers are ``answers``,
    the rows in lock-step as in a batch; ``answers[b][0]`` is the prefill's token. Exact at batch 1; in a
    batch a row may draft past its budget (up to the longest row's remaining tokens), which an answer that
    stops at ``max_new_tokens`` cannot judge: give batches answers of twice the budget."""
    if not cfg.greedy:
        raise ValueError("the replay knows the greedy answer only: use temperature=0")
    check_answers(answers, cfg)
    drafter = proposer(prompts, cfg, costs, vocab_size)
    policy = drafter.policy = new_policy(cfg, drafter.marginal_costs(cfg.draft_tokens))
    rows = Rows(len(prompts), cfg)
    out = DecodeOutput(tokens=rows.tokens)
    last = torch.tensor([answer[0] for answer in answers])
    rows.emit_tokens(last)
    positions, cost = torch.zeros(len(prompts), dtype=torch.long), 0.0
    while rows.active:
        limit = min(policy.draft_limit(), rows.most_remaining() - 1)
        r = Round(last, positions, rows.active_mask(last.device), limit, rows, 0)
        draft = drafter.propose(r)
        verdict = known_verdict(draft, rows, answers)
        done, _ = settle(rows, out, draft=draft, verdict=verdict, caches=[], start=0)
        policy.update(done.accepted, done.lengths)
        drafter.update(r, draft, verdict, done)
        cost += costs.round_cost(draft.k, 0.0)
        last = verdict.next_token
    return Replayed(out, cost, drafter)


@dataclass
class Tally:
    """One variant and policy summed over its calls (batch 1 each, as ``eval/speed.py`` decodes)."""

    rounds: int = 0
    tokens: int = 0  # emitted by the rounds (each call's first token comes from the prefill)
    cost: float = 0.0  # the rounds' cost in plain decoding steps
    drafting: int = 0  # rounds with a draft
    drafting_tokens: int = 0  # tokens the rounds with a draft emitted
    drafted: int = 0  # tokens drafted
    position_accepted: list[int] = field(default_factory=list)
    position_drafted: list[int] = field(default_factory=list)
    prior: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (n, i) -> [accepted, tried]

    def add(self, found: Replayed) -> None:
        out = found.out
        self.rounds += out.steps
        self.tokens += out.num_tokens - len(out.tokens)
        self.cost += found.cost
        self.drafting += sum(1 for d in out.drafted if d)
        self.drafting_tokens += sum(a + 1 for a, d in zip(out.accepted, out.drafted, strict=True) if d)
        self.drafted += sum(out.drafted)
        for name in ("position_accepted", "position_drafted"):
            mine, theirs = getattr(self, name), getattr(out, name)
            mine += [0] * (len(theirs) - len(mine))
            for i, count in enumerate(theirs):
                mine[i] += count
        for key, (accepted, tried) in found.proposer.stats.counts.items():
            tally = self.prior.setdefault(key, [0, 0])
            tally[0], tally[1] = tally[0] + accepted, tally[1] + tried

    @property
    def speedup(self) -> float:
        """Expected speedup over autoregressive decoding: tokens per plain step of the rounds."""
        return self.tokens / self.cost if self.cost else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / max(1, self.rounds)

    @property
    def draft_rate(self) -> float:
        """Rounds with a draft (with ``policy=constant``: rounds whose lookup matched) over all rounds."""
        return self.drafting / max(1, self.rounds)

    def lookup_prior(self, limit: int) -> str:
        """What ``fastdecode.plan.choose.LOOKUP_PRIOR`` holds: the share of rounds with a draft, the tokens such a
        round emits and the tokens it drafts, at up to ``limit`` drafts (the replay's ``draft_tokens``)."""
        rounds = max(1, self.drafting)
        return (
            f"LookupPrior(drafted={self.draft_rate:.3f}, tokens={self.drafting_tokens / rounds:.3f}, "
            f"width={self.drafted / rounds:.3f}, limit={limit})"
        )

    def acceptance(self) -> list[float]:
        """Per draft position i: how often it was accepted when drafted (given the earlier ones were)."""
        return [a / d for a, d in zip(self.position_accepted, self.position_drafted, strict=True) if d]


def measure(
    calls: Sequence[tuple[list[int], list[int]]],
    cfg: DecodeConfig,
    costs: CostModel,
    *,
    vocab_size: int,
    variants: Sequence[Variant],
    policies: Sequence[str],
) -> dict[tuple[Variant, str], Tally]:
    """Every variant under every policy over ``calls`` (``(prompt, answer)`` pairs), one call each."""
    found = {}
    for variant in variants:
        for policy in policies:
            tally = found[variant, policy] = Tally()
            run = replace(variant.config(cfg), policy=policy)
            for prompt, answer in calls:
                tally.add(replay([prompt], [answer], run, costs, vocab_size=vocab_size))
    return found


# --------------------------------------------------------------------------------------------------------
# The report
def best(found: dict[tuple[Variant, str], Tally], policy: str) -> list[tuple[Variant, Tally]]:
    """The variants under ``policy``, highest expected speedup first."""
    rows = [(variant, tally) for (variant, p), tally in found.items() if p == policy]
    return sorted(rows, key=lambda row: -row[1].speedup)


def prior_table(tally: Tally, draft_tokens: int) -> list[str]:
    """Markdown: conditional acceptance of draft position i after an n-token match, each cell accepted / tried,
    from a replay whose drafts were not cut (``policy=constant``); the last column is what ``MATCH_PRIOR``
    (``fastdecode.plan.acceptance``) holds per n: positions 1, 2 and 3 onwards pooled."""
    sizes = sorted({n for n, _ in tally.prior})
    lines = [
        "| n | "
        + " | ".join(f"position {i + 1}" for i in range(draft_tokens))
        + " | MATCH_PRIOR (1, 2, 3+) |",
        "| --- |" + " --- |" * (draft_tokens + 1),
    ]
    for n in sizes:
        cells, pooled = [], [[0, 0], [0, 0], [0, 0]]
        for i in range(draft_tokens):
            accepted, tried = tally.prior.get((n, i), (0, 0))
            cells.append(f"{accepted / tried:.2f} ({tried})" if tried else "-")
            pooled[min(i, 2)][0] += accepted
            pooled[min(i, 2)][1] += tried
        prior = ", ".join(f"{a / t:.2f}" if t else "-" for a, t in pooled)
        lines.append(f"| {n} | " + " | ".join(cells) + f" | ({prior}) |")
    return lines


def report(found: dict[tuple[Variant, str], Tally], policies: Sequence[str], draft_tokens: int) -> list[str]:
    """Markdown lines: every variant under every policy (the first policy's best first), which is best and
    by how much, and the acceptance prior of the best variant."""
    lines = [
        "| variant | policy | match rate | rounds with a draft | acceptance by draft position "
        "| tokens / round | expected speedup |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = [variant for variant, _ in best(found, policies[0])]
    for variant in order:
        matched = found.get((variant, "constant"))
        rate = f"{matched.draft_rate:.2f}" if matched else "-"
        for policy in policies:
            tally = found[variant, policy]
            accepted = " / ".join(f"{a:.2f}" for a in tally.acceptance()) or "-"
            lines.append(
                f"| {variant.label} | {policy} | {rate} | {tally.draft_rate:.2f} | {accepted} | "
                f"{tally.tokens_per_round:.2f} | {tally.speedup:.3f}x |"
            )
    ranked = best(found, policies[0])
    top, tally = ranked[0]
    lines += ["", f"Best under policy={policies[0]}: **{top.label}**, {tally.speedup:.3f}x"]
    if len(ranked) > 1:
        second, other = ranked[1]
        margin = 100 * (tally.speedup / other.speedup - 1)
        lines[-1] += f"; next {second.label}, {other.speedup:.3f}x ({margin:+.1f}%)."
    lines += [
        "",
        f"fastdecode.plan.choose.LOOKUP_PRIOR ({top.label}, policy={policies[0]}): {tally.lookup_prior(draft_tokens)}",
    ]
    if (top, "constant") in found:
        lines += ["", f"Acceptance prior ({top.label}, policy=constant):", ""]
        lines += prior_table(found[top, "constant"], draft_tokens)
    return lines
