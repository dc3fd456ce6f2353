"""Jacobi trajectory records -> CLLM training examples, batches, and the per-step state draws.

``build_examples`` makes one example per record (one block of one prompt) with everything that does not
depend on the drawn state. ``draw_states`` draws the state the student sees, per optimiser step, from
``state_uniforms``, so a resumed run draws what an uninterrupted one would. ``collate`` left-pads the prefix
and right-pads the block, so every row's block starts at the same column. Details: docs/design/methods.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from cllm_train.config import CLLMConfig
from cllm_train.records import check_manifest, iter_records, read_manifest
from fastdecode.config import ConfigError
from fastdecode.tokens import IGNORE_INDEX
from fastdecode.training.draws import row_uniforms

log = logging.getLogger(__name__)


def load_trajectories(
    directory: str | Path, tokenizer: Any, model_id: str, max_records: int | None = None
) -> tuple[dict, list[dict]]:
    """``(manifest, records)`` of a trajectory directory, checked against the model's tokenizer first.

    Raises ConfigError for another model or tokenizer, a malformed record (file and line), no record.
    """
    manifest = read_manifest(directory)
    check_manifest(manifest, tokenizer, model_id)
    if manifest.get("complete") is False:  # usable (only committed shards are read), but say so
        log.warning("%s: the collection did not finish; training on the records committed so far", directory)
    records = []
    for rec in iter_records(directory, manifest, vocab_size=len(tokenizer)):
        records.append(rec)
        if max_records is not None and len(records) >= max_records:
            break
    if not records:
        raise ConfigError(
            f"{directory}: the trajectory directory holds no record (every prompt filtered out, or the "
            "collection was stopped before its first shard). Collect more prompts with collect_jacobi.py."
        )
    return manifest, records


def _ar_sequence(rec: dict, cfg: CLLMConfig, prefix: list[int], cut: int) -> tuple[list[int], list[int]]:
    """AR input ids and HF-style labels (aligned with the ids) of one record, at most ``max_length`` long."""
    if cfg.ar_target == "fixed_point":  # the teacher sequence itself: x ⊕ y*
        ids = prefix + rec["fixed_point"]
        prompt = max(rec["prompt_len"] - cut, 0)
    else:
        prompt_ids, labels = rec["prefix"][: rec["prompt_len"]], rec["labels"]
        if len(prompt_ids) + len(labels) > cfg.max_length:  # keep the prompt if it fits, else half the budget
            labels = labels[: max(cfg.max_length - len(prompt_ids), cfg.max_length // 2)]
            prompt_ids = prompt_ids[max(len(prompt_ids) + len(labels) - cfg.max_length, 0) :]
        ids, prompt = prompt_ids + labels, len(prompt_ids)
    targets = list(ids)
    if cfg.mask_prompt:
        targets[:prompt] = [IGNORE_INDEX] * prompt
    return ids, targets


def build_examples(records: list[dict], cfg: CLLMConfig) -> list[dict]:
    """Training examples (lists of ids) from validated records; bad combinations fail with a ConfigError.

    The prefix is truncated on the left so that ``prefix ⊕ block`` fits ``cfg.max_length``; at least one
    prefix token stays (it predicts the first block token).
    """
    if cfg.uses_ar and cfg.ar_target == "labels":
        missing = [r for r in records if r["labels"] is None]
        if missing:
            raise ConfigError(
                f"recipe.ar_target=labels but {len(missing)} of {len(records)} records have labels=null (e.g. "
                f"prompt '{missing[0]['prompt_id']}' block {missing[0]['block']}): collect from a dataset "
                "with replies, or set recipe.ar_target=fixed_point."
            )
    examples = []
    for rec in records:
        n = len(rec["fixed_point"])
        if n + 1 > cfg.max_length:
            raise ConfigError(
                f"recipe.max_length={cfg.max_length} cannot hold one prefix token and a block of n={n} "
                f"(prompt '{rec['prompt_id']}'): use recipe.max_length >= {n + 1}."
            )
        prefix = rec["prefix"][-(cfg.max_length - n) :]
        cut = len(rec["prefix"]) - len(prefix)
        ex = {"prefix": prefix, "states": rec["states"], "first_mismatch": rec["first_mismatch"]}
        if cfg.uses_ar:
            ex["ar_ids"], ex["ar_labels"] = _ar_sequence(rec, cfg, prefix, cut)
        examples.append(ex)
    truncated = sum(len(r["prefix"]) + len(r["fixed_point"]) > cfg.max_length for r in records)
    if truncated:
        log.info(
            "%d of %d records: prefix cut on the left to max_length=%d",
            truncated,
            len(records),
            cfg.max_length,
        )
    return examples


def _right_pad(rows: list[list[int]], value: int, width: int | None = None) -> torch.Tensor:
    width = max(len(r) for r in rows) if width is None else width
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def collate(examples: list[dict], pad_id: int, ar_from_teacher: bool = False) -> dict[str, torch.Tensor]:
    """Pad a batch of ``build_examples`` rows.

    Returns:
        input_ids: ``[B, W = P + N]`` teacher sequences ``x ⊕ y*`` (prefix left-padded to P, block right-padded
            to N); attention_mask ``[B, W]`` (1 = token).
        states: ``[B, S, N]`` every state of the block; rows with fewer states repeat the fixed point.
        first_mismatch: ``[B, S]`` (``n`` for the fixed point and the repeats); block_len ``[B]``.
        labels: AR labels (HF-style, -100 = no loss): ``[B, W]`` aligned with input_ids when
            ``ar_from_teacher`` (ar_target=fixed_point), else ``[B, T]`` aligned with ar_input_ids/
            ar_attention_mask ``[B, T]`` (right-padded). All -100 ``[B, W]`` without AR loss.
    """
    prefix_w = max(len(ex["prefix"]) for ex in examples)
    block_w = max(len(ex["states"][0]) for ex in examples)
    num_states = max(len(ex["states"]) for ex in examples)
    ids, mask, states, mismatch, labels = [], [], [], [], []
    for ex in examples:
        lpad, n = prefix_w - len(ex["prefix"]), len(ex["states"][0])
        fixed = ex["states"][-1]
        ids.append([pad_id] * lpad + ex["prefix"] + fixed + [pad_id] * (block_w - n))
        mask.append([0] * lpad + [1] * (len(ex["prefix"]) + n) + [0] * (block_w - n))
        rows = ex["states"] + [fixed] * (num_states - len(ex["states"]))
        states.append([s + [pad_id] * (block_w - n) for s in rows])
        mismatch.append(ex["first_mismatch"] + [n] * (num_states - len(ex["states"])))
        if ar_from_teacher and "ar_labels" in ex:
            labels.append([IGNORE_INDEX] * lpad + ex["ar_labels"] + [IGNORE_INDEX] * (block_w - n))
    batch = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "attention_mask": torch.tensor(mask, dtype=torch.long),
        "states": torch.tensor(states, dtype=torch.long),
        "first_mismatch": torch.tensor(mismatch, dtype=torch.long),
        "block_len": torch.tensor([len(ex["states"][0]) for ex in examples], dtype=torch.long),
    }
    if "ar_ids" not in examples[0]:
        batch["labels"] = torch.full_like(batch["input_ids"], IGNORE_INDEX)
    elif ar_from_teacher:
        batch["labels"] = torch.tensor(labels, dtype=torch.long)
    else:
        batch["ar_input_ids"] = _right_pad([ex["ar_ids"] for ex in examples], pad_id)
        batch["ar_attention_mask"] = _right_pad([[1] * len(ex["ar_ids"]) for ex in examples], 0)
        batch["labels"] = _right_pad([ex["ar_labels"] for ex in examples], IGNORE_INDEX)
    return batch


def state_uniforms(seed: int, step: int, rank: int, rows: range) -> torch.Tensor:
    """``[len(rows)]`` float64 uniforms in [0, 1) for ``draw_states``: row ``r`` of the accumulated batch of
    optimiser step ``step`` on rank ``rank`` gets a pure function of (seed, step, rank, r), whatever the split
    into micro-batches."""
    return row_uniforms((seed, step, rank), rows)


def draw_states(
    first_mismatch: torch.Tensor, block_len: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """The student state per row, uniform among the row's non-fixed states (``m < n``); -1 if it has none.

    Args:
        first_mismatch: ``[B, S]``; block_len: ``[B]``; uniforms: ``[B]`` in [0, 1) (``state_uniforms``).
    Returns: ``[B]`` long state indices (on the input's device).
    """
    candidates = (first_mismatch < block_len[:, None]).cpu()  # [B, S]
    counts = candidates.sum(1)  # [B]
    kth = (uniforms.cpu() * counts).long().clamp(max=(counts - 1).clamp(min=0))  # [B]: which candidate
    order = candidates.long().cumsum(1) - 1  # [B, S]: candidate rank at each candidate column
    hit = candidates & (order == kth[:, None])
    picks = torch.where(counts > 0, hit.long().argmax(1), torch.full_like(counts, -1))
    return picks.to(first_mismatch.device)
