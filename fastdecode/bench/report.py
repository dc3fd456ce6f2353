"""Writers for the speed benchmark: environment record, JSON, CSV, Markdown, and plots (matplotlib Agg).

``write_report`` writes these files into ``output_dir``, each atomically: ``speed.json`` (everything;
undefined values are null, never NaN), ``summary.csv``, ``records.csv``, ``speed.md``, ``speedup.png``, and
when there is data for them ``category_summary.csv``, ``accept_hist.png``, ``oracle.png`` and ``sweep.png``.
What ``speed.md`` holds: docs/design/bench.md.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import io
import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from fastdecode.bench.categories import category_table
from fastdecode.bench.plots import plot_all
from fastdecode.files.io import atomic_write_text
from fastdecode.runtime.machine import cpu_name, machine_label

ROOT = Path(__file__).resolve().parents[2]
MD_COLUMNS = [
    ("method", "method", None),
    ("T", "temperature", None),
    ("batch", "batch_size", None),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("± (repeats)", "tokens_per_s_std", "{:.1f}"),
    ("ms/token", "ms_per_token", "{:.2f}"),
    ("speedup vs baseline", "speedup_vs_baseline", "{:.2f}x"),
    ("speedup vs HF", "speedup_vs_hf", "{:.2f}x"),
    ("TTFT ms", "ttft_ms", "{:.1f}"),
    ("accept rate", "acceptance_rate", "{:.2f}"),
    ("tokens/verify", "mean_accepted_length", "{:.2f}"),
    ("layers/token", "layers_per_token", "{:.1f}"),
    ("match vs baseline", "match_rate", "{:.3f}"),
    ("peak MB", "peak_memory_mb", "{:.0f}"),
    ("weights", "weights", None),
]


def git_state() -> dict:
    """The repository's commit and whether the working tree has changes (None outside a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain") if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def environment(job: Any, model: Any, exit_source: str) -> dict:
    """Hardware, library versions, dtype, git state and the resolved job config of this run."""
    import transformers

    device = model.device
    hardware = {"device": str(device), "cpu": cpu_name(), "cpu_cores": os.cpu_count()}
    hardware["torch_threads"] = torch.get_num_threads()
    hardware["machine"] = machine_label(device)  # "AMD EPYC, 1 thread": beside every figure of speed.md
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        hardware |= {"gpu": props.name, "gpu_memory_gb": round(props.total_memory / 2**30, 1)}
    return {
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(model.dtype).removeprefix("torch."),
        "num_layers": model.config.num_hidden_layers,
        "git": git_state(),
        "exit_layer_source": exit_source,
        "config": dataclasses.asdict(job),
    }


def finite(value: Any) -> Any:
    """``value`` with every NaN/inf float replaced by None (so the JSON is valid everywhere)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def to_csv(rows: list[dict]) -> str:
    """Rows as CSV (columns: the union of keys in first-seen order; lists and dicts as JSON)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(v) for k, v in row.items()})
    return buffer.getvalue()


def _fmt(value: Any, spec: str | None) -> str:
    if value is None:
        return "-"
    return spec.format(value) if spec else str(value)


def _expected(speedup: float | None) -> str:
    """A candidate's expected speedup; None: no prior recorded for it (``choose.with_corpus``)."""
    return "no prior recorded" if speedup is None else f"expected {speedup:.2f}x"


def auto_line(result: dict) -> str | None:
    """One line: the ``auto`` method's plan (expected speedups), what the ``auto`` row ran and how it fared
    against the best measured candidate per temperature and batch size, and the drafters not expected to pay
    (``Plan.not_paying``); None without ``auto``."""
    plan = result.get("plan")
    if not plan:
        return None
    planned = ", ".join(f"{c['name']} ({_expected(c['expected_speedup'])})" for c in plan["candidates"])
    best = {(row["temperature"], row["batch_size"]): row for row in result["summary"] if row.get("auto_best")}
    ran = []
    for row in result["summary"]:
        top = best.get((row["temperature"], row["batch_size"]))
        if "vs_best_candidate" not in row or top is None:
            continue
        ran.append(
            f"at T={row['temperature']}, batch {row['batch_size']} auto ran {', '.join(row.get('ran') or [])}: "
            f"{row['vs_best_candidate']:.3f}x the best candidate ({top['method']}, "
            f"{_fmt(top.get('speedup_vs_baseline'), '{:.2f}x')} vs baseline)"
        )
    skipped = []
    for item in plan["not_paying"]:
        detail = item.get("reason")
        if detail is None:
            detail = f"acceptance {item['acceptance']:.2f}, expected {item['expected_speedup']:.2f}x"
        skipped.append(f"{item['drafter']} at E={item['exit']} ({detail})")
    return (
        f"auto planned {planned}; {'; '.join(ran) or 'auto not measured'}; not expected to pay: "
        f"{', '.join(skipped) or 'none'}."
    )


def _method_cell(row: dict) -> str:
    return f"{row['method']} (auto best)" if row.get("auto_best") else row["method"]


def to_markdown(result: dict) -> str:
    """The summary table, the skipped methods and the oracle report as Markdown."""
    meta, hw = result["meta"], result["meta"]["hardware"]
    where = hw.get("machine") or hw.get("gpu") or f"{hw['cpu']}, {hw['torch_threads']} threads"
    cores = "" if hw.get("gpu") else f" ({hw['cpu_cores']} logical cores)"
    config = meta["config"]
    lines = [
        f"# Speed: {config['model']['name']} on {config['data']['name']}",
        "",
        f"Measured on {where}{cores}, {meta['dtype']}: {len(result['prompts'])} prompts, "
        f"max_new_tokens={config['max_new_tokens']}, repeats={config['repeats']}; torch {meta['torch']}, "
        f"transformers {meta['transformers']}, "
        f"git {str(meta['git']['commit'])[:10]}{' (dirty)' if meta['git']['dirty'] else ''}.",
        "",
        "| " + " | ".join(title for title, _, _ in MD_COLUMNS) + " |",
        "| " + " | ".join("---" for _ in MD_COLUMNS) + " |",
    ]
    for row in result["summary"]:
        cells = [_fmt(row.get(key), spec) for _, key, spec in MD_COLUMNS[1:]]
        lines.append("| " + " | ".join([_method_cell(row), *cells]) + " |")
    if (line := auto_line(result)) is not None:
        lines += ["", line]
    if result.get("category_summary"):
        lines += category_table(result["category_summary"])
    for skip in result["skipped"]:
        where = f"batch size {skip['batch_size']}, T={skip['temperature']}"
        lines.append(f"\nSkipped {skip['method']} at {where}: {skip['reason']}.")
    if result["oracle"]:
        lines += ["", "Oracle draft length (best K per verification, capped at the drafted K):", ""]
        lines += [
            "| method | verifications | cap | at cap | mean | std | p10 | median | p90 |",
            "| --- " * 9 + "|",
        ]
        for name, o in result["oracle"].items():
            values = [o["verifications"], o["draft_cap"], f"{o['capped_fraction']:.2f}", f"{o['mean']:.2f}"]
            values += [f"{o['std']:.2f}"]
            values += [o["p10"], o["median"], o["p90"]]
            lines.append(f"| {name} | " + " | ".join(str(v) for v in values) + " |")
    return "\n".join(lines) + "\n"


def write_report(result: dict, output_dir: str) -> Path:
    """Write every output file the module docstring lists into ``output_dir``; returns the JSON path."""
    out = Path(output_dir)
    clean = finite(result)
    atomic_write_text(out / "speed.json", json.dumps(clean, indent=2, allow_nan=False) + "\n")
    atomic_write_text(out / "summary.csv", to_csv(clean["summary"]))
    atomic_write_text(out / "records.csv", to_csv(clean["records"]))
    if clean.get("category_summary"):
        atomic_write_text(out / "category_summary.csv", to_csv(clean["category_summary"]))
    atomic_write_text(out / "speed.md", to_markdown(clean))
    plot_all(clean, out)
    return out / "speed.json"
