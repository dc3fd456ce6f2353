"""Deterministic splits of a training set: the held-out conversations and the input-grounded requests.

Both are set aside by hashing record ids, so a split depends on the ids only, and no training split ever
contains them; a set-aside record whose first user turn has a twin in the training split (``twins.py``) is
then dropped. ``grounded``: requests to rewrite, summarise, translate, fix, ... a text the turn itself gives
(``is_grounded_request``), chosen first. ``held_out``: plain conversations, chosen among the rest. Why
grounded requests matter: docs/design/data.md.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass

from fastdecode.data.twins import drop_twins, prompt_keys

SPLITS = ("all", "train", "held_out", "grounded")

# An instruction that works on given material ...
_VERB = re.compile(
    r"\b(rewrite|re-write|rephrase|paraphrase|summari[sz]e|translate|fix|correct|proofread|improve|edit|"
    r"convert|refactor|shorten|simplify)\b",
    re.IGNORECASE,
)
# ... and points at it.
_POINTER = re.compile(
    r"\b(this|these|following|below|given|text|code|paragraph|sentence|essay|email|function|script)\b",
    re.IGNORECASE,
)
GROUNDED_CHARS = (250, 2500)  # length of the whole turn (the instruction plus the material)
MIN_MATERIAL_CHARS = 200  # the given text after the instruction
MAX_INSTRUCTION_CHARS = 300  # the instruction: the turn up to its first line break or colon
MIN_ASCII = 0.97  # English-script text (the embedded model is English)


def first_user_turn(record: dict) -> str | None:
    return next((m["content"] for m in record["messages"] if m["role"] == "user"), None)


def is_grounded_request(text: str) -> bool:
    """True when ``text`` (a user turn) is a short instruction to rewrite/summarise/translate/fix/... followed
    by the material it works on: at least ``MIN_MATERIAL_CHARS`` after the instruction's first line break or
    colon, and the instruction names the material (``this``, ``the following``, ``code``, ...)."""
    low, high = GROUNDED_CHARS
    if not low <= len(text) <= high or sum(c.isascii() for c in text) < MIN_ASCII * len(text):
        return False
    cuts = [i for i in (text.find("\n"), text.find(":")) if i >= 0]
    if not cuts or min(cuts) > MAX_INSTRUCTION_CHARS:
        return False
    instruction, material = text[: min(cuts)], text[min(cuts) + 1 :].strip()
    return (
        bool(_VERB.search(instruction) and _POINTER.search(instruction))
        and len(material) >= MIN_MATERIAL_CHARS
    )


def _ranked_ids(records: list[dict], seed: int, salt: str) -> list[str]:
    ids = list(dict.fromkeys(r["id"] for r in records))
    return sorted(ids, key=lambda rid: hashlib.sha256(f"{seed}:{salt}{rid}".encode()).hexdigest())


def _take(ranked: list[str], count: Counter, wanted: int) -> set[str]:
    """The first ids of ``ranked`` holding ``wanted`` records (records sharing an id stay together)."""
    taken: set[str] = set()
    held = 0
    for rid in ranked:
        if held >= wanted:
            break
        taken.add(rid)
        held += count[rid]
    return taken


@dataclass(frozen=True)
class Split:
    """The parts of a split, and per set-aside part how many records were dropped for a twin in ``train``."""

    train: list[dict]
    held_out: list[dict]
    grounded: list[dict]
    twins: dict[str, int]


def split_parts(records: list[dict], held_out: int, seed: int, grounded: int = 0) -> Split:
    """Deterministic, disjoint parts; each keeps the input order.

    ``grounded`` records are the first of the matching records (``is_grounded_request`` on the first user
    turn) by ``sha256(seed:grounded:id)``; ``held_out`` the first of the others by ``sha256(seed:id)`` (the
    held-out ranking of every earlier release). With unique ids exactly ``held_out`` and ``grounded`` records
    are set aside (fewer grounded when fewer match); then those whose first user turn has a twin in the
    training split (``twins.prefix_key``) are dropped: neither trained on nor evaluated, so the training split
    is the one of every earlier release.
    """
    count = Counter(r["id"] for r in records)
    grounded_ids: set[str] = set()
    if grounded:
        matching = [r for r in records if is_grounded_request(first_user_turn(r) or "")]
        grounded_ids = _take(_ranked_ids(matching, seed, "grounded:"), count, grounded)
    rest = [r for r in records if r["id"] not in grounded_ids]
    held_ids = _take(_ranked_ids(rest, seed, ""), count, held_out)
    train = [r for r in rest if r["id"] not in held_ids]
    trained = prompt_keys(first_user_turn(r) for r in train)
    held, held_twins = drop_twins([r for r in rest if r["id"] in held_ids], trained, first_user_turn)
    aside, aside_twins = drop_twins([r for r in records if r["id"] in grounded_ids], trained, first_user_turn)
    return Split(train, held, aside, {"held_out": held_twins, "grounded": aside_twins})


def split_records(
    records: list[dict], held_out: int, seed: int, grounded: int = 0
) -> tuple[list[dict], list[dict], list[dict]]:
    """``(train, held_out, grounded)`` of ``split_parts``."""
    parts = split_parts(records, held_out, seed, grounded)
    return parts.train, parts.held_out, parts.grounded
