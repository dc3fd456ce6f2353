"""What a checkpoint records about its drafters: the acceptance ``auto`` plans with, kept inside the checkpoint.

``acceptance.json`` in a model directory lists, per drafter, its greedy agreement with the final layer and
the tokens a round of K drafts yields (``replay_rounds``), measured on the model's own answers to held-out
prompts. ``read_record`` refuses a damaged record by name (``RecordError``). What is recorded, and why rounds
are replayed: docs/design/plan.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdecode.config import ConfigError
from fastdecode.files.io import atomic_write_json

RECORD_FILE = "acceptance.json"
RECORD_FORMAT = 1
MAX_REPLAYED_DRAFT = 8  # tokens_per_round is replayed for K = 1 .. this

# Prior conditional acceptance of a text drafter (prompt lookup, suffix decoding) at draft position i (1, 2,
# 3+) after an n-token match, weighing MATCH_PRIOR_WEIGHT drafts: the last column of the table `fastdecode-lookup-replay` prints (the default lookup replayed over
# SmolLM2-135M-Instruct's greedy answers to 128 ShareGPT training prompts, drafts of 6 not cut; no evaluation
# set): a 1-token match's first token lands about one time in five, a 4-token match's nine in ten
# (docs/BENCHMARKS.md, "Prompt lookup: which occurrence, which n, where EOS cuts").
MATCH_PRIOR = {1: (0.21, 0.54, 0.74), 2: (0.44, 0.61, 0.79), 3: (0.65, 0.70, 0.77), 4: (0.90, 0.90, 0.92)}
MATCH_PRIOR_WEIGHT = 4.0


class RecordError(ConfigError):
    """A checkpoint's acceptance record cannot be read; the message names the file and the fix."""


@dataclass
class DrafterRecord:
    """One drafter's recorded acceptance (docs/design/plan.md)."""

    drafter: str
    acceptance: float
    exit_layer: int | None = None
    draft_vocab: str | None = None  # a file name relative to the record (None: the full head)
    tokens_per_round: dict[int, float] = field(default_factory=dict)


@dataclass
class AcceptanceRecord:
    drafters: list[DrafterRecord]
    measured_on: str = ""
    tokens: int = 0
    directory: Path | None = None  # where it was read from (draft vocabularies are relative to it)

    def find(self, drafter: str) -> list[DrafterRecord]:
        return [d for d in self.drafters if d.drafter == drafter]

    def path_of(self, name: str | None) -> str | None:
        """A file the record names, as a path (None stays None)."""
        if name is None or self.directory is None:
            return name
        return str(self.directory / name)


def replay_rounds(matches: Sequence[Sequence[bool]], max_draft: int = MAX_REPLAYED_DRAFT) -> dict[int, float]:
    """Tokens per round of greedy speculation with a constant draft length K, for K = 1..``max_draft``.

    ``matches[s][j]``: whether the drafter's prediction of generated token j of sequence s equals it (the
    final layer's greedy token), with every earlier token given. Greedy speculation from that prefix drafts
    exactly those predictions while they match, so a round starting at token j accepts the run of matches
    from j (at most K, and never past the last token but one: the verifier adds one) and emits it plus the
    verifier's token: the next round starts one token after the accepted run. Exact for greedy decoding of
    one row; the first generated token comes from the prefill (not a round).
    """
    leads = []
    for seq in matches:  # lead[j]: the run of matches from token j
        lead, run = [0] * len(seq), 0
        for j in range(len(seq) - 1, -1, -1):
            run = run + 1 if seq[j] else 0
            lead[j] = run
        leads.append(lead)
    return replay_leads(leads, max_draft)


def replay_leads(leads: Sequence[Sequence[int]], max_draft: int = MAX_REPLAYED_DRAFT) -> dict[int, float]:
    """``replay_rounds`` from ``leads[s][j]``: how many drafts from token j of sequence s match (at least
    ``max_draft`` where more do): a round at j emits ``min(lead[j], K, n - 1 - j) + 1`` tokens (the verifier
    adds one; drafts stop one short of the end) and the next round starts after them."""
    out = {}
    for k in range(1, max_draft + 1):
        tokens = rounds = 0
        for lead in leads:
            j = 1
            while j < len(lead):
                accepted = min(lead[j], k, len(lead) - 1 - j)
                tokens, rounds, j = tokens + accepted + 1, rounds + 1, j + accepted + 1
        out[k] = tokens / rounds if rounds else 1.0
    return out


def write_record(directory: str | os.PathLike, record: AcceptanceRecord) -> Path:
    """``acceptance.json`` in ``directory`` (a checkpoint, or its export's staging directory), atomically."""
    body = {
        "format": RECORD_FORMAT,
        "measured_on": record.measured_on,
        "tokens": record.tokens,
        "drafters": [dataclasses.asdict(d) for d in record.drafters],
    }
    return atomic_write_json(Path(directory) / RECORD_FILE, body)


def _drafter(item: Any, path: Path) -> DrafterRecord:
    if not isinstance(item, dict):
        raise ValueError(f"a drafter entry is {type(item).__name__}, not an object")
    known = {f.name for f in dataclasses.fields(DrafterRecord)}
    found = DrafterRecord(**{k: v for k, v in item.items() if k in known})
    if not isinstance(found.drafter, str) or not 0.0 <= float(found.acceptance) <= 1.0:
        raise ValueError(f"drafter {found.drafter!r}: acceptance {found.acceptance!r} is not in [0, 1]")
    found.acceptance = float(found.acceptance)
    found.exit_layer = None if found.exit_layer is None else int(found.exit_layer)
    found.tokens_per_round = {int(k): float(v) for k, v in (found.tokens_per_round or {}).items()}
    if any(v < 1.0 for v in found.tokens_per_round.values()):
        raise ValueError(f"drafter {found.drafter!r}: tokens_per_round below 1")
    return found


def read_record(directory: str | os.PathLike | None) -> AcceptanceRecord | None:
    """The record of a model directory, or None when it has none; a damaged one raises ``RecordError``."""
    if not directory:
        return None
    path = Path(directory) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise ValueError(f"not an acceptance record of format {RECORD_FORMAT}")
        drafters = [_drafter(item, path) for item in data.get("drafters") or []]
    except (OSError, ValueError, TypeError) as err:
        raise RecordError(
            f"{path} is damaged ({err}); delete it (auto then drafts by prompt lookup alone) or write it again "
            f"with `python eval/exits.py checkpoint={Path(directory)} record=true`."
        ) from err
    return AcceptanceRecord(
        drafters, str(data.get("measured_on", "")), int(data.get("tokens", 0)), Path(directory)
    )


def exit_record(generations: dict, *, draft_vocab: str | None, measured_on: str) -> AcceptanceRecord:
    """The record of a model's raw exits from an exit report's ``generations`` section
    (``fastdecode.reports.exits.generation_report``): per exit but the last, with the full head, and with the
    draft vocabulary file ``draft_vocab`` (its name beside the record) when the report scored one."""
    drafters = []
    for prefix, vocab_file in (("", None), ("draft_vocab_", draft_vocab)):
        rounds = generations.get(f"{prefix}tokens_per_round") or {}
        for exit_layer, value in (generations.get(f"{prefix}agreement") or {}).items():
            if exit_layer in rounds:  # every exit but the last (the model itself)
                drafters.append(
                    DrafterRecord("exit", float(value), exit_layer, vocab_file, rounds[exit_layer])
                )
    return AcceptanceRecord(drafters, measured_on, int(generations.get("tokens", 0)))
