"""Conversations to training rows: chat-template tokenisation with assistant-only labels, packing, collation.

Label convention (Hugging Face): ``labels`` are aligned with ``input_ids`` and the model shifts them, so the
logits at position t are trained on ``labels[t + 1]``; -100 marks a position with no loss.

Packed rows hold several samples; ``position_ids`` restart at 0 for each, and attention is block-diagonal causal
(``block_causal_mask``), so samples never see each other. The first label of every sample is -100, so the last
token of one sample is never trained to predict the first token of the next.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Any

import torch

from fastdecode.config import ConfigError
from fastdecode.data.config import DataConfig, check_trainable
from fastdecode.data.sources import load_records, read_records_with_stats
from fastdecode.data.splits import split_records
from fastdecode.runtime.progress import Progress, phase
from fastdecode.tokens import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "additive_from_bool",
    "block_causal_mask",
    "build_datasets",
    "collate",
    "pack",
    "split_records",
    "tokenize_conversation",
]

logger = logging.getLogger(__name__)
_MARGIN = 64  # characters: tokens this close to a cut in the text may differ from the full tokenization


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def user_prompt_text(tokenizer: Any, user: str) -> str:
    """The chat-templated text of a one-turn chat (``user`` says ``user``) ending with the assistant's
    generation prompt: what a completion server is sent to continue exactly our prompt ids."""
    return _render(tokenizer, [{"role": "user", "content": user}], generation_prompt=True)


def user_prompt_ids(tokenizer: Any, user: str) -> list[int]:
    """Token ids of a one-turn chat (``user`` says ``user``) ending with the assistant's generation prompt:
    what the model continues when asked ``user`` (the template already holds any special tokens)."""
    return tokenizer(user_prompt_text(tokenizer, user), add_special_tokens=False).input_ids


def training_prompts(
    cfg: DataConfig, tokenizer: Any, count: int, max_tokens: int
) -> list[tuple[str, list[int]]]:
    """``(first user turn, its prompt ids: user_prompt_ids)`` of the first ``count`` conversations of ``cfg``'s
    training split (never a held-out or input-grounded one) whose prompt has at most ``max_tokens`` tokens, in
    split order: the prompts the model's own answers are generated for."""
    out = []
    for rec in load_records(dataclasses.replace(cfg, max_samples=None), "train"):
        user = next((t["content"] for t in rec["messages"] if t["role"] == "user"), "")
        if not user.strip():
            continue
        ids = user_prompt_ids(tokenizer, user)
        if len(ids) <= max_tokens:
            out.append((user, ids))
        if len(out) == count:
            break
    return out


def assistant_spans(
    tokenizer: Any, messages: list[dict], text: str | None = None, until: int | None = None
) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the assistant replies in ``text`` (the rendered conversation).

    A span runs from the end of the generation prompt (the template rendered up to that turn with
    ``add_generation_prompt=True``) through the first end-of-turn token (``tokenizer.eos_token``) after the
    reply, or to the end of the turn's rendering when the template has no such token there. Replies starting
    at or after character ``until`` are skipped (they fall beyond the truncation point).
    """
    text = _render(tokenizer, messages) if text is None else text
    until = len(text) if until is None else until
    spans, cursor = [], 0
    eos = tokenizer.eos_token or ""
    for k, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt, upto = _render(tokenizer, messages[:k], True), _render(tokenizer, messages[: k + 1])
        if text.startswith(upto) and upto.startswith(prompt):
            start, turn_end = len(prompt), len(upto)
        else:  # the template rewrites earlier turns: locate the reply in the full text instead
            start = text.find(msg["content"].strip(), cursor)
            if start < 0:
                raise ConfigError(
                    f"assistant turn {k} ({msg['content'].strip()[:40]!r}) is not in the conversation as the "
                    "tokenizer's chat template renders it (the template rewrites or drops that reply), so its "
                    "labels cannot be placed: set data.assistant_only_loss=false (every token a label) or use "
                    "a tokenizer whose template keeps assistant replies as they are (model.tokenizer=...)."
                )
            turn_end = len(text)
        if start >= until:
            break
        content_at = text.find(msg["content"].strip(), start, turn_end)
        eos_at = text.find(eos, max(content_at, start), turn_end) if eos else -1
        end = eos_at + len(eos) if eos_at >= 0 else turn_end
        spans.append((start, end))
        cursor = end
    return spans


def _tokenize_prefix(tokenizer: Any, text: str, max_length: int) -> tuple[list[int], list[tuple[int, int]]]:
    """The first ``max_length`` token ids of ``text`` and their character offsets.

    Only a prefix of a long text is tokenized (grown until it holds enough tokens); tokens ending within
    ``_MARGIN`` characters of the cut are discarded, so the kept ones match the tokenization of the whole text.
    """
    budget = 8 * max_length + _MARGIN
    while True:
        cut = min(len(text), budget)
        enc = tokenizer(text[:cut], add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        if cut < len(text):
            keep = bisect.bisect_right([hi for _, hi in offsets], cut - _MARGIN)
            ids, offsets = ids[:keep], offsets[:keep]
            if len(ids) < max_length:
                budget *= 4
                continue
        return ids[:max_length], offsets[:max_length]


def tokenize_conversation(
    tokenizer: Any, messages: list[dict], max_length: int, assistant_only_loss: bool = True
) -> dict[str, list[int]]:
    """``{"input_ids": [T], "labels": [T]}`` with T <= max_length (right-truncated).

    With ``assistant_only_loss`` the labels are -100 except on assistant reply tokens and the end-of-turn token
    that closes each reply; otherwise every token but the first is a label. Needs a fast tokenizer (offsets).
    """
    text = _render(tokenizer, messages)
    ids, offsets = _tokenize_prefix(tokenizer, text, max_length)
    if not assistant_only_loss:
        return {"input_ids": ids, "labels": [IGNORE_INDEX] + ids[1:]}
    spans = assistant_spans(tokenizer, messages, text, until=offsets[-1][1] if offsets else 0)
    labels = [IGNORE_INDEX] * len(ids)
    s = 0
    for t, (lo, hi) in enumerate(offsets):
        while s < len(spans) and spans[s][1] <= lo:
            s += 1
        if s < len(spans) and lo < spans[s][1] and hi > spans[s][0] and hi > lo:
            labels[t] = ids[t]
    return {"input_ids": ids, "labels": labels}


def pack(examples: list[dict], max_length: int) -> list[dict]:
    """Greedy next-fit packing of tokenized examples into rows of at most ``max_length`` tokens, order kept.

    Each row: ``input_ids``/``labels``/``position_ids`` ([T_row] lists, T_row <= max_length) and ``seq_lens``
    (the sample lengths, summing to T_row). The first label of each sample is set to -100.
    """
    rows: list[dict] = []
    for ex in examples:
        n = len(ex["input_ids"])
        if n > max_length:
            raise ValueError(
                f"example of {n} tokens is longer than max_length={max_length}; truncate it first"
            )
        if not rows or len(rows[-1]["input_ids"]) + n > max_length:
            rows.append({"input_ids": [], "labels": [], "position_ids": [], "seq_lens": []})
        row = rows[-1]
        row["input_ids"] += ex["input_ids"]
        row["labels"] += [IGNORE_INDEX] + list(ex["labels"][1:])
        row["position_ids"] += list(range(n))
        row["seq_lens"].append(n)
    return rows


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] position ids -> [B, 1, T, T] bool mask (True = attend): causal within each sample, blocked across.

    A new sample starts wherever the position does not follow the previous one by 1 (a restart at 0).
    """
    position_ids = position_ids.long()
    step = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1)
    segment = (step != 1).cumsum(-1)  # [B, T]
    same = segment[:, :, None] == segment[:, None, :]  # [B, T, T]
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def additive_from_bool(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bool mask of any shape (True = attend) -> the same shape as a float mask to add to attention scores:
    0 or the dtype's minimum. Converts values only: causality must already be in ``mask``."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill(~mask, torch.finfo(dtype).min)


def collate(
    examples: list[dict], pad_id: int, mask_dtype: torch.dtype = torch.float32, four_d: bool | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad a batch: ``input_ids``, ``labels`` (-100 padding), ``position_ids`` [B, T], ``attention_mask``.

    Padding forms its own segment (positions from 0), so it never leaks into real tokens. ``attention_mask`` is
    [B, T] (1 = token) for unpacked rows, and a [B, 1, T, T] additive block-causal mask of ``mask_dtype`` (pass
    the model dtype) when a row holds several samples (``four_d=None``) or when ``four_d`` is true. Hugging Face
    models use a 4D mask as given.
    """
    width = max(len(ex["input_ids"]) for ex in examples)
    ids, labels, pos, pad_mask = [], [], [], []
    for ex in examples:
        n, pad = len(ex["input_ids"]), width - len(ex["input_ids"])
        lens = ex.get("seq_lens") or [n]
        ids.append(list(ex["input_ids"]) + [pad_id] * pad)
        labels.append(list(ex["labels"]) + [IGNORE_INDEX] * pad)
        pos.append([p for m in lens for p in range(m)] + list(range(pad)))
        pad_mask.append([1] * n + [0] * pad)
    batch = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
        "position_ids": torch.tensor(pos, dtype=torch.long),
    }
    if four_d is None:
        four_d = any(len(ex.get("seq_lens") or [0]) > 1 for ex in examples)
    if four_d:
        batch["attention_mask"] = additive_from_bool(block_causal_mask(batch["position_ids"]), mask_dtype)
    else:
        batch["attention_mask"] = torch.tensor(pad_mask, dtype=torch.long)
    return batch


def _tokenize_all(
    records: list[dict], tokenizer: Any, cfg: DataConfig, progress: Progress | None = None
) -> tuple[list[dict], int, int]:
    """Tokenized examples, how many were truncated, how many dropped for having no label token left;
    ``progress`` counts the records."""
    out, truncated, dropped = [], 0, 0
    for rec in records:
        if progress is not None:
            progress.update()
        ex = tokenize_conversation(tokenizer, rec["messages"], cfg.max_length + 1, cfg.assistant_only_loss)
        if len(ex["input_ids"]) > cfg.max_length:
            truncated += 1
            ex = {k: v[: cfg.max_length] for k, v in ex.items()}
        if all(label == IGNORE_INDEX for label in ex["labels"][1:]):
            dropped += 1
            continue
        first_user = next((t["content"] for t in rec["messages"] if t["role"] == "user"), "")
        out.append(ex | {"id": rec["id"], "prompt": first_user})  # prompt: for generation-based reports
    return out, truncated, dropped


def build_datasets(cfg: DataConfig, tokenizer: Any) -> tuple[list[dict], list[dict]]:
    """Training and held-out examples for ``cfg``: read, split, cap, tokenize, filter, pack (train only).

    Examples are dicts with ``input_ids``/``labels`` (and ``position_ids``/``seq_lens`` when packed); the
    held-out examples are never packed, so evaluation loss is per conversation.
    """
    check_trainable(cfg)
    records, stats = read_records_with_stats(cfg)
    train_recs, held_recs, _ = split_records(records, cfg.held_out, cfg.split_seed, cfg.grounded)
    if cfg.max_samples is not None:
        train_recs = train_recs[: cfg.max_samples]
    n = len(train_recs)
    what = f"tokenizing {n} training conversation{'s' if n != 1 else ''}"
    with phase(f"data '{cfg.name}'", what, total=n, unit="conversation", logger=logger) as progress:
        train, truncated, dropped = _tokenize_all(train_recs, tokenizer, cfg, progress)
    held, _, held_dropped = _tokenize_all(held_recs, tokenizer, cfg)
    if not train:
        cleaning = ", ".join(f"{n} {why}" for why, n in sorted(stats.dropped.items())) or "none"
        raise ConfigError(
            f"dataset '{cfg.name}' is empty after filtering ({stats.read} read, {len(records)} kept after "
            f"cleaning (dropped: {cleaning}), {len(held_recs)} held out, {dropped} dropped because no "
            f"assistant token fits in max_length={cfg.max_length}); raise data.max_length, lower "
            "data.held_out, shorten data.system_prompt, or check the source."
        )
    tokens = sum(len(ex["input_ids"]) for ex in train)
    logger.info(
        "data '%s': %d conversations -> %d train examples (%d tokens, %d truncated to %d, %d dropped with no "
        "label token), %d held-out examples (%d dropped)",
        cfg.name,
        len(records),
        len(train),
        tokens,
        truncated,
        cfg.max_length,
        dropped,
        len(held),
        held_dropped,
    )
    if cfg.packing:
        train = pack(train, cfg.max_length)
        logger.info(
            "data '%s': packed into %d rows of <= %d tokens (%.0f%% full)",
            cfg.name,
            len(train),
            cfg.max_length,
            100 * tokens / max(1, len(train) * cfg.max_length),
        )
    return train, held
