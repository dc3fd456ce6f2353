"""The records of the feature cache (``features.py``, whose docstring gives the schema), computed by the frozen
model: teacher-forced on training sequences (``batch_features``: one right-padded causal forward) or captured
while the model generates its own greedy answers (``generation_features``: batched, KV-cached, left-padded).
"""

from __future__ import annotations

import torch

from fastdecode.data.chat import IGNORE_INDEX
from fastdecode.decoding.common import left_pad
from fastdecode.runtime.cache import KVCache
from fastdecode.runtime.model import EarlyExitModel


def scored_positions(labels: list[int]) -> list[int]:
    """Positions t whose next token (``labels[t + 1]``, HF's aligned labels) is labelled."""
    return [t for t in range(len(labels) - 1) if labels[t + 1] != IGNORE_INDEX]


@torch.no_grad()
def batch_features(
    m: EarlyExitModel, examples: list[dict], exits: list[int], top_k: int, dtype: torch.dtype
) -> list[dict[str, torch.Tensor]]:
    """Records (module docstring) of ``examples`` from one right-padded, causal forward of the frozen model."""
    lengths = [len(ex["input_ids"]) for ex in examples]
    width, device = max(lengths), m.device
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    for row, ex in enumerate(examples):
        ids[row, : lengths[row]] = torch.tensor(ex["input_ids"])
    ids = ids.to(device)
    positions = torch.arange(width, device=device).expand(len(examples), -1)
    # Right padding + causal attention: a real position never sees a pad, so no padding mask is needed.
    captured, final = _segments(m, m.embed(ids, positions), exits, positions)
    records = []
    for row, ex in enumerate(examples):
        n = lengths[row]
        scored = torch.tensor(scored_positions(ex["labels"]), dtype=torch.long, device=device)
        head_in = final[row, scored]  # [N, H']
        argmax, top_ids, top_logp = _targets(m.head_logits(head_in), top_k)
        labels = torch.tensor(ex["labels"], dtype=torch.long, device=device)
        record = {
            "input_ids": ids[row, :n].int(),
            "scored": scored.int(),
            "targets": labels[scored + 1].int(),
            "teacher": argmax.int(),
            "topk_ids": top_ids.int(),
            "topk_logp": top_logp,
            "final": head_in.to(dtype),
        }
        for exit_layer, h in captured.items():
            record[f"h{exit_layer}"] = h[row, :n].to(dtype)
        records.append(record)
    return records


def _targets(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(argmax, top-k ids, top-k log-probabilities) of ``[..., V]`` logits (full-vocabulary softmax)."""
    logp = torch.log_softmax(logits.float(), -1)
    top = logp.topk(min(top_k, logp.shape[-1]), -1)
    return logp.argmax(-1), top.indices, top.values


def _segments(m: EarlyExitModel, hidden, exits, positions, cache=None) -> tuple[dict, torch.Tensor]:
    """Run every layer, keeping the residual stream at each exit: ``({E: [B, T, H]}, final head input)``."""
    done, captured = 0, {}
    for exit_layer in sorted(exits):
        hidden = m.run_layers(hidden, done, exit_layer, positions, cache=cache)
        captured[exit_layer], done = hidden, exit_layer
    return captured, m.exit_hidden(m.run_layers(hidden, done, m.num_layers, positions, cache=cache))


@torch.no_grad()
def generation_features(
    m: EarlyExitModel,
    prompts: list[list[int]],
    exits: list[int],
    top_k: int,
    dtype: torch.dtype,
    *,
    max_new_tokens: int,
    eos: set[int],
) -> list[dict[str, torch.Tensor]]:
    """The model's greedy answers to ``prompts``, as records (module docstring) captured while decoding
    (batched, KV-cached, left-padded): the sequence is the prompt and every answer token fed back, the scored
    positions predict the answer tokens (the first from the prompt's last position), the targets are the
    answer itself (greedy: the teacher's argmax)."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids, valid, positions = left_pad(prompts, m.device)
    cache = m.new_cache(batch, width + max_new_tokens)
    cache.reserve(valid, 0, positions)
    captured, final = _segments(m, m.embed(ids, positions), exits, positions, cache)
    steps = [({e: h[:, -1:] for e, h in captured.items()}, final[:, -1])]  # step 0 = the prefill's last
    prompt_feats = {
        e: [h[row, width - len(p) :] for row, p in enumerate(prompts)] for e, h in captured.items()
    }
    answers, per_step = _greedy_answers(
        m, prompts, exits, top_k, cache=cache, steps=steps, eos=eos, max_new_tokens=max_new_tokens
    )
    return [
        _generation_record(
            row, prompt, answers[row], exits, dtype, steps=steps, per_step=per_step, prompt_feats=prompt_feats
        )
        for row, prompt in enumerate(prompts)
    ]


def _greedy_answers(
    m: EarlyExitModel,
    prompts: list[list[int]],
    exits: list[int],
    top_k: int,
    *,
    cache: KVCache,
    steps: list[tuple[dict[int, torch.Tensor], torch.Tensor]],
    eos: set[int],
    max_new_tokens: int,
) -> tuple[list[list[int]], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Greedy decoding after the prefill (its last step in ``steps``): each step's exit features ``[B, 1, H]``
    and head input ``[B, H']`` appended to ``steps``; returns the answers and, per step, the targets
    (argmax ``[B]``, top-k ids and log-probabilities ``[B, k]``)."""
    batch, device = len(prompts), m.device
    answers: list[list[int]] = [[] for _ in prompts]
    done = [False] * batch
    next_pos = torch.tensor([len(p) for p in prompts], device=device)
    logits = m.head_logits(steps[-1][1])
    per_step = []
    for _ in range(max_new_tokens):
        argmax, top_ids, top_logp = _targets(logits, top_k)
        per_step.append((argmax, top_ids, top_logp))
        for row, token in enumerate(argmax.tolist()):
            if not done[row]:
                answers[row].append(token)
                done[row] = token in eos or len(answers[row]) >= max_new_tokens
        if all(done):
            break
        active = torch.tensor([not d for d in done], device=device)
        pos = next_pos[:, None]
        cache.reserve(active[:, None], cache.lengths[0], pos)
        captured, final = _segments(m, m.embed(argmax[:, None], pos), exits, pos, cache)
        steps.append((captured, final[:, -1]))
        logits = m.head_logits(final[:, -1])
        next_pos = next_pos + active.long()
    return answers, per_step


def _generation_record(
    row: int,
    prompt: list[int],
    answer: list[int],
    exits: list[int],
    dtype: torch.dtype,
    *,
    steps: list[tuple[dict[int, torch.Tensor], torch.Tensor]],
    per_step: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    prompt_feats: dict[int, list[torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The record of batch row ``row``: the prompt and its answer fed back (all but the last token)."""
    n, p = len(answer), len(prompt)
    record = {
        "input_ids": torch.tensor(prompt + answer[:-1], dtype=torch.int32),
        "scored": torch.arange(p - 1, p + n - 1, dtype=torch.int32),
        "targets": torch.tensor(answer, dtype=torch.int32),
        "teacher": torch.stack([per_step[j][0][row] for j in range(n)]).int(),
        "topk_ids": torch.stack([per_step[j][1][row] for j in range(n)]).int(),
        "topk_logp": torch.stack([per_step[j][2][row] for j in range(n)]),
        "final": torch.stack([steps[j][1][row] for j in range(n)]).to(dtype),
    }
    for e in exits:  # prompt positions, then the answer tokens fed back (all but the last)
        fed = [steps[j][0][e][row, 0] for j in range(1, n)]
        record[f"h{e}"] = torch.cat([prompt_feats[e][row], *([torch.stack(fed)] if fed else [])]).to(dtype)
    return record
