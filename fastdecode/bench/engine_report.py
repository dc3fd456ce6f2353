"""``engine.md``: the execution-engine micro-benchmark's result (``fastdecode/bench/engine.py``) as Markdown."""

from __future__ import annotations


def to_markdown(result: dict) -> str:
    """The Markdown of a result of ``fastdecode.bench.engine.run`` (one section per thread count, headed by the
    machine it was measured on: ``fastdecode.runtime.machine.machine_label``)."""
    job = result["job"]
    lines = [
        f"# Execution engine: {result['model']} ({result['dtype']}, {result['device']}, {result['cpu']})",
        "",
        f"torch {result['torch']}, transformers {result['transformers']}, git {result['git'].get('commit')}"
        f"{' (dirty)' if result['git'].get('dirty') else ''}; cache of {job['context']} tokens, E = "
        f"{job['exit_layer']}, {job['repeats']} interleaved rounds of {job['calls']} calls (median, [min-max]).",
    ]
    for threads, entry in result["threads"].items():
        mach = entry["machine"]
        lines += [
            "",
            f"## {entry.get('measured_on') or f'{threads} thread(s)'}: bandwidth {mach['bandwidth_gb_s']:.1f} GB/s, fp32 GEMM "
            f"{mach['gemm_gflop_s']:.0f} GFLOP/s",
            "",
        ]
        lines += _forward_table(entry["forward"], job)
        lines += _overhead_line(entry.get("layer_overhead"))
        for key, label in (("autoregressive", "fp32"), ("autoregressive_bf16", "bf16")):
            if key in entry:
                lines += _autoregressive_table(entry[key], label, job["ar_new_tokens"])
        plans = entry.get("plans") or {}
        if plans:
            lines += [
                "",
                "Kernel plans (M = 1, 2, ...): "
                + "; ".join(f"{k}: {'/'.join(v[:17])}" for k, v in plans.items()),
            ]
    return "\n".join(lines) + "\n"


def _forward_table(fwd: dict, job: dict) -> list[str]:
    """Forward cost per component and path at each T, with the ratios of medians and (below) of minima."""
    steps = job["steps"]
    lines = [
        "Forward cost: median ms, and (ratio to the same path at T=1 / to HF at T=1), ratios of medians;"
        " below each row the ratios of the minima",
        "",
        "| component | path | " + " | ".join(f"T={t}" for t in steps) + " |",
        "|" + " --- |" * (len(steps) + 2),
    ]
    for comp in job["components"]:
        for path, table in fwd["paths"].items():
            cells = [table[comp][str(t)] for t in steps]
            medians = [f"{s['median_ms']:.2f} ({s['vs_own_T1']:.2f}x / {s['vs_hf_T1']:.2f}x)" for s in cells]
            mins = [
                f"min {s['min_ms']:.2f} ({s['vs_own_T1_min']:.2f}x / {s['vs_hf_T1_min']:.2f}x)" for s in cells
            ]
            lines.append(f"| {comp} | {path} | " + " | ".join(medians) + " |")
            lines.append("| | | " + " | ".join(mins) + " |")
    if fwd["compile_seconds"]:
        lines += ["", f"Compile time (all graphs): {fwd['compile_seconds']}"]
    return lines


def _overhead_line(over: dict | None) -> list[str]:
    """Per-layer-call overhead per path (none when not measured)."""
    if not over:
        return []
    calls = ", ".join(
        f"{p} {v['median']:.0f} us [{v['min']:.0f}-{v['max']:.0f}] ({over['ratio_vs_hf'][p]:.2f}x)"
        for p, v in over["us_per_layer_call"].items()
    )
    return ["", "Per-layer-call overhead (narrow model, T=1): ", calls]


def _autoregressive_table(ar: dict, label: str, new_tokens: int) -> list[str]:
    """Autoregressive tok/s per batch and method against HF ``generate`` and the roofline."""
    lines = [
        "",
        f"Autoregressive ({label}, {new_tokens} new tokens): roofline "
        f"{ar['roofline_tok_s']:.1f} tok/s ({ar['weights_mb_per_token']:.0f} MB of weights per token)",
        "",
        "| batch | method | tok/s [min-max] | vs HF generate (medians / best runs) | of roofline | tokens = HF |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for batch_key, row in ar.items():
        if not batch_key.startswith("batch") or batch_key.endswith("seconds"):
            continue
        for name, r in row.items():
            lines.append(
                f"| {batch_key[5:]} | {name} | {r['tok_s']:.1f} [{r['min']:.1f}-{r['max']:.1f}] | "
                f"{r['vs_hf_generate']:.2f}x / {r['vs_hf_generate_best']:.2f}x | "
                f"{r['tok_s'] / ar['roofline_tok_s']:.2f} | "
                f"{'yes' if r['tokens_equal_hf_generate'] else 'no'} |"
            )
        first = ar.get(f"{batch_key}_first_call_seconds")
        if first:
            lines.append(f"| {batch_key[5:]} | first compiled call (compile included) | {first} s | | | |")
    return lines
