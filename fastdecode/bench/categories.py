"""Results per prompt category, as Spec-Bench reports MT-bench (writing, roleplay, reasoning, math, ...).

Only prompt sets whose records carry a ``category`` field get any of this. The module owns the round-robin
choice of prompts across categories (``round_robin``), the per-category summary (``category_summary``) and
its Markdown table (``category_table``). Why, and how calls are counted: docs/design/bench.md.
"""

from __future__ import annotations

from collections import defaultdict

from fastdecode.bench.stats import Record, summarise

CATEGORY_COLUMNS = (
    "method",
    "category",
    "temperature",
    "batch_size",
    "calls",
    "new_tokens",
    "wall_time_s",
    "tokens_per_s",
    "speedup_vs_baseline",
    "speedup_vs_baseline_std",
    "speedup_vs_hf",
    "acceptance_rate",
    "mean_accepted_length",
    "match_rate",
)


def round_robin(records: list[dict], n_prompts: int | None) -> list[dict]:
    """``records`` in the order prompts are taken: round-robin across their ``category`` when every record has
    one and ``n_prompts`` is below their number; otherwise unchanged."""
    if n_prompts is None or n_prompts >= len(records) or not all("category" in r for r in records):
        return records
    by_category: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        by_category[str(record["category"])].append(record)
    queues, ordered = list(by_category.values()), []
    for i in range(max(len(q) for q in queues)):
        ordered += [q[i] for q in queues if i < len(q)]
    return ordered


def prompt_categories(records: list[dict], prompt_ids: list[str]) -> dict[str, str] | None:
    """``{prompt id: category}`` of the prompts run, or None when the set has no categories."""
    found = {str(r["id"]): str(r["category"]) for r in records if r.get("category") is not None}
    if not found:
        return None
    return {pid: found[pid] for pid in prompt_ids if pid in found}


def record_category(record: Record) -> str | None:
    """The category of a call: its prompts' one category, None when they mix categories or have none."""
    found = set(record.categories or [])
    return next(iter(found)) if len(found) == 1 and None not in found else None


def category_summary(records: list[Record], baseline: str | None, hf_baseline: str | None) -> list[dict]:
    """One row per (temperature, batch size, method, category) over the calls of one category
    (docs/design/bench.md); ``[]`` when no call has a category."""
    by_category: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        category = record_category(record)
        if category is not None:
            by_category[category].append(record)
    rows = []
    for category, recs in by_category.items():
        for row in summarise(recs, baseline, hf_baseline):
            row["category"] = category
            rows.append({key: row.get(key) for key in CATEGORY_COLUMNS})
    return rows


def _speedup(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def category_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per (temperature, batch size), speedup vs the baseline per method (rows) and category
    (columns), categories in the order they ran."""
    groups: dict[tuple, dict[str, dict[str, float | None]]] = defaultdict(lambda: defaultdict(dict))
    categories = list(dict.fromkeys(row["category"] for row in rows))
    for row in rows:
        groups[(row["temperature"], row["batch_size"])][row["method"]][row["category"]] = row[
            "speedup_vs_baseline"
        ]
    lines = []
    for (temperature, size), methods in groups.items():
        lines += ["", f"Speedup vs baseline per category (T={temperature}, batch {size}):", ""]
        lines += ["| method | " + " | ".join(categories) + " |", "| --- " * (len(categories) + 1) + "|"]
        for method, values in methods.items():
            cells = [_speedup(values.get(category)) for category in categories]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines
