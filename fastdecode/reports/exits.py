"""Per-exit quality: how well each early exit predicts what the full model predicts.

Two measurements, both teacher-forced through ``EarlyExitModel`` one layer at a time. On held-out data, per
exit: top-1 agreement with the final layer and the perplexity of the labels (``held_out_report``). On the
model's own greedy generations, per exit: top-1 agreement with the final layer on the generated tokens, the
greedy draft acceptance self-speculative decoding with that exit will see (``generation_report``).
Exit ``l`` (1-based count of blocks run) means ``exit_logits`` after block ``l-1``; exit ``L`` is the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fastdecode.data.chat import user_prompt_ids
from fastdecode.plan.acceptance import replay_rounds
from fastdecode.runtime.machine import machine_label
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.runtime.progress import Progress, phase
from fastdecode.tokens import IGNORE_INDEX, next_token_nll, next_token_targets, perplexity


@dataclass
class ExitStats:
    """Running sums per exit (keyed by blocks run, 1..L)."""

    agree: dict[int, float] = field(default_factory=dict)
    nll: dict[int, float] = field(default_factory=dict)
    tokens: int = 0

    def add(self, other_agree: dict[int, float], other_nll: dict[int, float], tokens: int) -> None:
        for k, v in other_agree.items():
            self.agree[k] = self.agree.get(k, 0.0) + v
        for k, v in other_nll.items():
            self.nll[k] = self.nll.get(k, 0.0) + v
        self.tokens += tokens

    def summary(self) -> dict[str, dict[int, float]]:
        n = max(self.tokens, 1)
        out = {"agreement": {k: v / n for k, v in sorted(self.agree.items())}}
        if self.nll:
            out["perplexity"] = {k: perplexity(v, self.tokens) for k, v in sorted(self.nll.items())}
        return out


@torch.no_grad()
def exit_predictions(
    m: EarlyExitModel,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor | None = None,
    vocab: torch.Tensor | None = None,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, float]]:
    """Every exit's top-1 prediction at the scored positions of one row.

    Args:
        input_ids: ``[1, T]`` tokens.
        mask: ``[T]`` bool, positions whose *next-token prediction* is scored.
        labels: ``[T]`` next-token targets (already shifted: ``labels[t]`` is the token after ``t``), or None.
        vocab: ``[S]`` draft vocabulary ids, or None.
    Returns: ``(preds, vocab_preds, nll_sums)`` keyed by blocks run (1..L): ``[N]`` predictions through the
    full head, through the draft vocabulary's rows (full-vocabulary ids; empty without ``vocab``), and the
    labels' NLL sums (empty without labels).
    """
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    hidden = m.embed(input_ids, positions)
    preds, vocab_preds, nll = {}, {}, {}
    for layer in range(m.num_layers):
        hidden = m.run_layers(hidden, layer, layer + 1, positions)
        logits = m.exit_logits(hidden[0, mask]).float()  # [N, V]: only the scored positions
        preds[layer + 1] = logits.argmax(-1)
        if vocab is not None:
            vocab_preds[layer + 1] = vocab[logits[:, vocab].argmax(-1)]
        if labels is not None:
            nll[layer + 1] = F.cross_entropy(logits, labels[mask], reduction="sum").item()
    return preds, vocab_preds, nll


def score_sequence(
    m: EarlyExitModel, input_ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None = None
) -> tuple[dict[int, float], dict[int, float], int]:
    """Agreement (and label NLL) sums of every exit on one row (``exit_predictions``'s arguments).
    Returns: ``(agree_sums, nll_sums, scored_positions)`` keyed by blocks run (1..L)."""
    preds, _, nll = exit_predictions(m, input_ids, mask, labels)
    final = preds[m.num_layers]
    agree = {k: (p == final).sum().item() for k, p in preds.items()}
    return agree, nll, int(mask.sum().item())


def held_out_report(
    m: EarlyExitModel, examples: list[dict], max_examples: int | None = None, progress: Progress | None = None
) -> dict:
    """Per-exit agreement and perplexity on tokenized examples (``input_ids``/``labels`` lists); ``progress``
    counts the examples."""
    stats = ExitStats()
    for ex in examples[:max_examples]:
        ids = torch.tensor(ex["input_ids"], device=m.device)[None]
        labels = next_token_targets(torch.tensor(ex["labels"], device=m.device))
        mask = labels != IGNORE_INDEX
        if mask.any():
            stats.add(*score_sequence(m, ids, mask, labels))
        if progress is not None:
            progress.update()
    return stats.summary() | {"tokens": stats.tokens}


@torch.no_grad()
def greedy_generations(
    model, tokenizer, prompts: list[str], max_new_tokens: int, progress: Progress | None = None
) -> list[tuple[list, int]]:
    """``(token ids, prompt length)`` of the model's greedy continuation of each chat prompt; ``progress``
    counts the prompts."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([user_prompt_ids(tokenizer, prompt)], device=model.device)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        out.append((gen[0].tolist(), ids.shape[1]))
        if progress is not None:
            progress.update()
    return out


@torch.no_grad()
def generation_report(
    m: EarlyExitModel,
    generations: list[tuple[list, int]],
    vocab: torch.Tensor | None = None,
    progress: Progress | None = None,
) -> dict:
    """Per-exit top-1 agreement with the final layer on the model's own greedy tokens (draft acceptance),
    and the tokens a round of K drafts yields (``fastdecode.plan.acceptance.replay_rounds``); with ``vocab`` (a
    draft vocabulary ``[S]``) the same through its rows (``draft_vocab_*``); ``progress`` counts the
    generations."""
    heads = {"": {}, "draft_vocab_": {}} if vocab is not None else {"": {}}
    vocab = None if vocab is None else vocab.to(m.device)
    tokens = 0
    for ids, prompt_len in generations:
        seq = torch.tensor(ids, device=m.device)[None]
        mask = torch.zeros(len(ids), dtype=torch.bool, device=m.device)
        mask[prompt_len - 1 : len(ids) - 1] = True  # predictions of the generated tokens
        if progress is not None:
            progress.update()
        if not mask.any():
            continue
        preds, vocab_preds, _ = exit_predictions(m, seq, mask, vocab=vocab)
        final = preds[m.num_layers]
        for prefix, found in (("", preds), ("draft_vocab_", vocab_preds)):
            for exit_layer, pred in found.items():
                heads[prefix].setdefault(exit_layer, []).append((pred == final).tolist())
        tokens += int(mask.sum())
    report: dict = {"tokens": tokens}
    for prefix, matches in heads.items():
        report[f"{prefix}agreement"] = {
            e: sum(map(sum, rows)) / max(tokens, 1) for e, rows in sorted(matches.items())
        }
        report[f"{prefix}tokens_per_round"] = {
            e: replay_rounds(rows) for e, rows in sorted(matches.items()) if e < m.num_layers
        }
    return report


@torch.no_grad()
def adapter_generation_report(
    m: EarlyExitModel, adapters: dict, generations: list[tuple[list, int]], vocab: torch.Tensor | None = None
) -> dict:
    """Per exit E of ``adapters`` (E -> ``ExitAdapter``): top-1 agreement with the final layer on the model's
    own greedy tokens of the raw exit and of the exit through its adapter, both through the drafter's head
    (the draft vocabulary ``vocab [S]`` when given: argmax within it, as drafting does), and the tokens a
    round of K drafts yields (``tokens_per_round``, ``fastdecode.plan.acceptance.replay_rounds``). This is the
    greedy draft acceptance of self-speculation with that drafter."""
    matches: dict[str, dict[int, list[list[bool]]]] = {"raw": {}, "adapter": {}}
    tokens = 0

    def draft_argmax(hidden: torch.Tensor) -> torch.Tensor:
        if vocab is None:
            return m.exit_logits(hidden).argmax(-1)
        return vocab[m.exit_logits_subset(hidden, vocab).argmax(-1)]

    for ids, prompt_len in generations:
        seq = torch.tensor(ids, device=m.device)[None]
        positions = torch.arange(len(ids), device=m.device)[None]
        mask = torch.zeros(len(ids), dtype=torch.bool, device=m.device)
        mask[prompt_len - 1 : len(ids) - 1] = True
        if not mask.any():
            continue
        hidden, done, preds = m.embed(seq, positions), 0, {}
        for exit_layer in sorted(adapters):
            hidden = m.run_layers(hidden, done, exit_layer, positions)
            done = exit_layer
            out = adapters[exit_layer](m, hidden, positions)
            preds[exit_layer] = {"raw": draft_argmax(hidden[0, mask]), "adapter": draft_argmax(out[0, mask])}
        hidden = m.run_layers(hidden, done, m.num_layers, positions)
        final = m.exit_logits(hidden[0, mask]).argmax(-1)
        for exit_layer, found in preds.items():
            for head, pred in found.items():
                matches[head].setdefault(exit_layer, []).append((pred == final).tolist())
        tokens += int(mask.sum())
    n = max(tokens, 1)
    return {
        **{
            head: {e: sum(map(sum, rows)) / n for e, rows in sorted(found.items())}
            for head, found in matches.items()
        },
        "tokens_per_round": {
            head: {e: replay_rounds(rows) for e, rows in sorted(found.items())}
            for head, found in matches.items()
        },
        "tokens": tokens,
        "head_rows": m.vocab_size if vocab is None else len(vocab),
    }


@torch.no_grad()
def model_perplexity(m: EarlyExitModel, examples: list[dict], max_examples: int | None = None) -> dict:
    """The model's (final layer's) perplexity on the labelled tokens of ``examples`` and the token count."""
    nll, tokens = 0.0, 0
    for ex in examples[:max_examples]:
        ids = torch.tensor(ex["input_ids"], device=m.device)[None]  # [1, T]
        labels = torch.tensor(ex["labels"], device=m.device)[None]  # [1, T], shifted by next_token_nll
        positions = torch.arange(ids.shape[1], device=m.device)[None]
        hidden = m.run_layers(m.embed(ids, positions), 0, m.num_layers, positions)
        total, count = next_token_nll(hidden, labels, m.exit_logits)
        nll, tokens = nll + float(total), tokens + count
    return {"perplexity": perplexity(nll, tokens), "tokens": tokens}


def plot_reports(reports: dict[str, dict], path: str) -> None:
    """Agreement-with-final per exit, one line per report (e.g. before/after training), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, report in reports.items():
        for kind, style in (("generations", "-"), ("held_out", "--")):
            agreement = report.get(kind, {}).get("agreement")
            if agreement:
                xs = sorted(int(k) for k in agreement)
                ax.plot(
                    xs,
                    [agreement[k] if k in agreement else agreement[str(k)] for k in xs],
                    style,
                    label=f"{label}: {kind}",
                )
    ax.set_xlabel("exit E (blocks run)")
    ax.set_ylabel("top-1 agreement with the final layer")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def exit_report(
    model,
    tokenizer,
    held_out: list[dict],
    prompts: list[str],
    max_new_tokens: int,
    *,
    max_examples: int,
    generations: list[tuple[list, int]] | None = None,
    name: str = "exit report",
    vocab: torch.Tensor | None = None,
) -> dict:
    """Both measurements for ``model``: ``{"held_out": {...}, "generations": {...}}`` (see module doc), on
    ``generations`` when given (``greedy_generations`` of ``prompts``, made once for several reports), else
    on the model's greedy generations of ``prompts``; with ``vocab`` (a draft vocabulary) the generations'
    agreement through its rows too. Logged as the phase ``name`` with its progress: every exit's head runs on
    every scored position, so a report takes minutes on a CPU."""
    m = EarlyExitModel(model)
    was_training = model.training
    model.eval()
    examples = held_out[:max_examples]
    to_generate = len(prompts) if generations is None else 0
    scored = len(prompts) if generations is None else len(generations)
    detail = (
        f"{to_generate} greedy generations of up to {max_new_tokens} tokens, then " if to_generate else ""
    )
    detail += f"all {m.num_layers} exits scored on {scored} generations and {len(examples)} held-out examples"
    total = to_generate + scored + len(examples)
    with phase(name, detail, total=total, unit="sequence") as progress:
        if generations is None:
            generations = greedy_generations(model, tokenizer, prompts, max_new_tokens, progress)
        report = {
            "held_out": held_out_report(m, examples, progress=progress),
            "generations": generation_report(m, generations, vocab, progress),
            "num_layers": m.num_layers,
        }
    model.train(was_training)
    return report


def agreement_text(agreement: dict) -> str:
    """Per-exit agreement as text, exits in order: ``"E=1 0.06, E=2 0.09, ..."``."""
    return ", ".join(f"E={e} {agreement[e]:.2f}" for e in sorted(agreement, key=int))


def adapter_agreement_text(report: dict) -> str:
    """``adapter_generation_report``'s agreement as text, raw exit -> adapter: ``"E=4 0.31 -> 0.52, ..."``."""
    raw, adapter = report["raw"], report["adapter"]
    return ", ".join(f"E={e} {raw[e]:.2f} -> {adapter[e]:.2f}" for e in sorted(adapter, key=int))


def choice_sentence(choice: dict, measured_on: str | None = None) -> str:
    """``fastdecode.plan.choose.choose_exit``'s result as one sentence naming what decided it: "recommended exit
    E=12 with K=3 drafts, expected at 1.25x of autoregressive decoding (cost model measured on AMD EPYC, 1
    thread)", or "no exit is expected to speed decoding up yet: the best, E=29 with K=1, is expected at 0.78x
    of autoregressive decoding (...)". ``measured_on``: the ``fastdecode.runtime.machine.machine_label`` of where the
    cost model was measured (None: this CPU at the current thread count)."""
    costs = {
        "measured": f"cost model measured on {measured_on or machine_label()}",
        "estimated": "cost model estimated from the weights each part reads",
    }.get(choice.get("costs"), "")
    costs = f" ({costs})" if costs else ""
    if choice.get("exit") is not None:
        return (
            f"recommended exit E={choice['exit']} with K={choice['draft']} drafts, expected at "
            f"{choice['expected_speedup']:.2f}x of autoregressive decoding{costs}"
        )
    found = choice.get("best_found") or {}
    if found.get("exit") is None:
        return f"no exit is expected to speed decoding up yet: no exit was measured{costs}"
    return (
        f"no exit is expected to speed decoding up yet: the best, E={found['exit']} with K={found['draft']}, "
        f"is expected at {found['expected_speedup']:.2f}x of autoregressive decoding{costs}"
    )
