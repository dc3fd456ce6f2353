"""Plots of a speed result (matplotlib, Agg backend), each saved atomically as PNG.

- ``speedup.png``: speedup vs the baseline per method, one panel per (temperature, batch size), error bars = std
  over repeats;
- ``accept_hist.png``: tokens per verification (accepted drafts + 1), normalised, per speculative method;
- ``oracle.png``: the best draft length per verification (``DecodeOutput.oracle``), per method;
- ``sweep.png``: speedup vs the baseline over exit layer x draft length (``mode=sweep``), per group.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from fastdecode.files.io import atomic_path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110)
    _pyplot().close(fig)


def _groups(summary: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in summary:
        groups[(row["temperature"], row["batch_size"])].append(row)
    return groups


def plot_speedup(summary: list[dict], path: Path) -> None:
    """Bars of ``speedup_vs_baseline`` (grid variants left to the heatmap), one panel per group."""
    plt = _pyplot()
    groups = _groups([r for r in summary if not r.get("grid")] or summary)
    fig, axes = plt.subplots(
        1,
        len(groups),
        figsize=(max(5.0, 1.2 * max(map(len, groups.values()))) * len(groups), 4),
        squeeze=False,
    )
    for ax, ((temp, size), rows) in zip(axes[0], groups.items(), strict=True):
        names = [r["method"] for r in rows]
        values = [r["speedup_vs_baseline"] or 0.0 for r in rows]
        errors = [r["speedup_vs_baseline_std"] or 0.0 for r in rows]
        ax.bar(range(len(rows)), values, yerr=errors, capsize=3, color="tab:blue")
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right")
        ax.set_title(f"T={temp}, batch {size}")
        ax.set_ylabel("speedup vs baseline (tokens/s ratio)")
    fig.tight_layout()
    _save(fig, path)


def plot_histograms(series: dict[str, dict], path: Path, xlabel: str) -> None:
    """Normalised histograms (``{method: {value: count}}``) as grouped bars."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for i, (name, hist) in enumerate(series.items()):
        total = sum(hist.values()) or 1
        xs = [int(k) for k in hist]
        ax.bar(
            [x + (i - (len(series) - 1) / 2) * width for x in xs],
            [v / total for v in hist.values()],
            width,
            label=name,
        )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of verifications")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def plot_sweep(summary: list[dict], path: Path) -> None:
    """Heatmap of ``speedup_vs_baseline`` over (exit layer, draft tokens), one panel per group."""
    plt = _pyplot()
    groups = _groups([r for r in summary if r.get("grid")])
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.5), squeeze=False)
    for ax, ((temp, size), rows) in zip(axes[0], groups.items(), strict=True):
        exits = sorted({r["grid"][0] for r in rows})
        drafts = sorted({r["grid"][1] for r in rows})
        grid = [[float("nan")] * len(drafts) for _ in exits]
        for r in rows:
            speedup = r["speedup_vs_baseline"]
            grid[exits.index(r["grid"][0])][drafts.index(r["grid"][1])] = speedup or float("nan")
        image = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white", fontsize=8)
        ax.set_xticks(range(len(drafts)), drafts)
        ax.set_yticks(range(len(exits)), exits)
        ax.set_xlabel("draft tokens K")
        ax.set_ylabel("exit layer E")
        ax.set_title(f"speedup vs baseline, T={temp}, batch {size}")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    _save(fig, path)


def plot_all(result: dict, out: Path) -> list[Path]:
    """Every plot that has data; returns the paths written."""
    written = []
    if result["summary"]:
        plot_speedup(result["summary"], out / "speedup.png")
        written.append(out / "speedup.png")
    accept = {
        f"{r['method']} (T={r['temperature']}, b={r['batch_size']})": r["accept_length_histogram"]
        for r in result["summary"]
        if r.get("accept_length_histogram")
    }
    if accept:
        plot_histograms(accept, out / "accept_hist.png", "tokens per verification (accepted + 1)")
        written.append(out / "accept_hist.png")
    oracle = {name: o["histogram"] for name, o in result["oracle"].items()}
    if oracle:
        plot_histograms(
            oracle, out / "oracle.png", "oracle draft length (leading drafts the verifier agrees with)"
        )
        written.append(out / "oracle.png")
    if any(r.get("grid") for r in result["summary"]):
        plot_sweep(result["summary"], out / "sweep.png")
        written.append(out / "sweep.png")
    return written
