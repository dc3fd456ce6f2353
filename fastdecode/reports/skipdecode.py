"""SkipDecode quality: how far the policy's outputs are from the full model's, and what it costs in layers.

- ROUGE-L (LCS F1 on token ids) of the ``skipdecode`` decoder's greedy outputs against the full model's greedy
  outputs on the same prompt batches (batches matter: the budget schedule is shared by a batch);
- perplexity of reference continuations (labelled tokens of tokenized examples) under the policy, teacher-forced
  with the exact forward of ``fastdecode/skipdecode.py``, next to the full model's;
- decoder layers run per generated token, for both decoders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from fastdecode.data.chat import collate
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.skipdecode import policy_from_config
from fastdecode.registry import DECODERS
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.skipdecode import SkipDecodePolicy, policy_hidden, response_starts
from fastdecode.tokens import IGNORE_INDEX, next_token_nll, perplexity


def lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (O(len(a) * len(b)), one row of memory)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0  # row[j-1] of the previous row
        for j, y in enumerate(b, start=1):
            diagonal, row[j] = row[j], diagonal + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l(candidate: Sequence[int], reference: Sequence[int]) -> float:
    """ROUGE-L F1 = 2PR / (P + R) with P = LCS/len(candidate), R = LCS/len(reference); 1.0 for two empties."""
    if not candidate and not reference:
        return 1.0
    lcs = lcs_length(candidate, reference)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


def split_examples(examples: list[dict]) -> list[list[int]]:
    """Prompts of tokenized examples: ``input_ids`` before the first label (what a decoder is given)."""
    prompts = []
    for ex in examples:
        start = int(response_starts(torch.tensor([ex["labels"]]))[0])
        prompts.append(list(ex["input_ids"][:start]))
    return prompts


@torch.no_grad()
def policy_perplexity(
    m: EarlyExitModel,
    policy_for: Callable[[int], SkipDecodePolicy],
    examples: list[dict],
    batch_size: int = 8,
) -> dict:
    """Perplexity of the labelled tokens of ``examples`` (``input_ids``/``labels`` lists) under a policy.

    ``policy_for(longest_prompt)`` gives each batch's policy (its ``max_length`` may depend on the prompts).
    Also returns the mean budget (layers) of the labelled positions: what decoding them would cost.
    """
    nll, tokens, layers = 0.0, 0, 0
    for i in range(0, len(examples), batch_size):
        batch = collate(examples[i : i + batch_size], pad_id=0)
        ids, labels = batch["input_ids"].to(m.device), batch["labels"].to(m.device)
        starts = response_starts(labels)
        answered = starts[starts < ids.shape[1]]
        policy = policy_for(int(answered.max()) if len(answered) else 0)
        hidden = policy_hidden(m, policy, ids, labels, batch["position_ids"].to(m.device))
        batch_nll, batch_tokens = next_token_nll(hidden, labels, m.exit_logits)
        nll, tokens = nll + batch_nll.item(), tokens + batch_tokens
        budgets = policy.row_budgets(starts, ids.shape[1])
        layers += int(budgets[labels.cpu() != IGNORE_INDEX].sum())
    return {
        "nll": nll / max(tokens, 1),
        "perplexity": perplexity(nll, tokens),
        "tokens": tokens,
        "layers": layers / max(tokens, 1),
    }


def skipdecode_quality(
    m: EarlyExitModel,
    prompts: list[list[int]],
    cfg: DecodeConfig,
    examples: list[dict] | None = None,
    batch_size: int = 8,
) -> dict:
    """Compare ``decoder=skipdecode`` with ``cfg`` against full-depth greedy decoding on ``prompts``.

    Returns mean ROUGE-L and exact-match rate of the outputs, layers per token of both, and (with
    ``examples``) the perplexity of their reference continuations under the policy and at full depth.
    """
    if not cfg.greedy:
        raise ValueError("skipdecode_quality compares greedy outputs: use temperature=0")
    full_cfg = replace(cfg, exit_layer=None)
    scores, exact, layers = [], 0, {"skipdecode": 0, "full": 0}
    generated = {"skipdecode": 0, "full": 0}
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        skip = DECODERS["skipdecode"](m, batch, cfg)
        full = DECODERS["autoregressive"](m, batch, full_cfg)
        for ours, ref in zip(skip.tokens, full.tokens, strict=True):
            scores.append(rouge_l(ours, ref))
            exact += int(ours == ref)
        for name, out in (("skipdecode", skip), ("full", full)):
            layers[name] += out.layers_run
            generated[name] += out.num_tokens
    report = {
        "prompts": len(prompts),
        "rouge_l": sum(scores) / max(len(scores), 1),
        "exact_match": exact / max(len(prompts), 1),
        "layers_per_token": {k: layers[k] / max(generated[k], 1) for k in layers},
    }
    if examples:
        num_layers = m.num_layers
        report["perplexity"] = {
            "skipdecode": policy_perplexity(m, lambda p: policy_from_config(cfg, num_layers, p), examples),
            "full": policy_perplexity(
                m, lambda p: policy_from_config(_full_depth(cfg, num_layers), num_layers, p), examples
            ),
        }
    return report


def _full_depth(cfg: DecodeConfig, num_layers: int) -> DecodeConfig:
    """``cfg`` with every budget at full depth (the policy then runs the whole model everywhere)."""
    return replace(cfg, skip=replace(cfg.skip, max_budget=num_layers, min_budget=num_layers))
