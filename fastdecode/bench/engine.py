"""The execution-engine micro-benchmark behind ``eval/engine.py`` (``configs/engine.yaml``).

It measures every path side by side in one process, interleaved, per thread count: the machine (memory
bandwidth, GEMM peak), forward costs against the number of new tokens, per-layer-call overhead, and
autoregressive decoding against HF ``generate``. It writes ``engine.json`` and ``engine.md``. The job and its
paths are ``engine_job.py``, the measurements ``engine_costs.py``, the Markdown ``engine_report.py``. What
each measurement runs: docs/design/bench.md.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from fastdecode.bench.engine_costs import autoregressive, forward_costs, layer_overhead, machine
from fastdecode.bench.engine_job import EngineJob, path_options
from fastdecode.bench.engine_report import to_markdown
from fastdecode.config import ConfigError, to_dataclass
from fastdecode.runtime.model import EarlyExitModel

log = logging.getLogger(__name__)


def run(cfg: Any) -> dict:
    """Run the benchmark of ``configs/engine.yaml``; write ``engine.json`` and ``engine.md``; return it."""
    from fastdecode.files.io import atomic_write_json, atomic_write_text, check_writable
    from fastdecode.runtime.loading import load_model

    job = to_dataclass(EngineJob, cfg, "")
    check_writable(job.output_dir)  # before the model loads
    model, _ = load_model(job.model)
    m = EarlyExitModel(model)
    if not 1 <= job.exit_layer < m.num_layers:
        raise ConfigError(f"exit_layer={job.exit_layer}: use 1 <= exit_layer <= {m.num_layers - 1}.")
    result = _header(job, m)
    saved_threads = torch.get_num_threads()
    try:
        for threads in job.threads:
            torch.set_num_threads(threads)
            log.info("%d thread(s)", threads)
            result["threads"][str(threads)] = _measure_threads(m, job)
    finally:
        torch.set_num_threads(saved_threads)
    out = Path(job.output_dir)
    atomic_write_json(out / "engine.json", result)
    atomic_write_text(out / "engine.md", to_markdown(result))
    return result


def _header(job: EngineJob, m: EarlyExitModel) -> dict[str, Any]:
    """What the result says about the run: model, dtype, device, CPU, versions, git state, the job."""
    import transformers

    from fastdecode.bench.report import git_state
    from fastdecode.runtime.machine import cpu_name

    return {
        "model": job.model.name,
        "dtype": str(m.dtype),
        "device": str(m.device),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git": git_state(),
        "job": dataclasses.asdict(job),
        "threads": {},
    }


def _measure_threads(m: EarlyExitModel, job: EngineJob) -> dict[str, Any]:
    """Every measurement of the job at the current thread count."""
    from fastdecode.runtime.loading import load_model
    from fastdecode.runtime.machine import machine_label

    entry: dict[str, Any] = {
        "measured_on": machine_label(m.device),
        "machine": machine(m.device, job.bandwidth_mb),
    }
    entry["forward"] = forward_costs(m, job)
    engine = m.use_engine(path_options("engine", m.device))
    entry["engine_build_seconds"] = engine.build_seconds if engine else None
    entry["plans"] = engine.plans if engine else {}
    # seconds per sweep of each kernel at each probed M: the measurement behind the plans
    entry["calibration"] = engine.timings if engine else {}
    m.use_engine(None)
    if job.overhead:
        entry["layer_overhead"] = layer_overhead(job, [p for p in job.paths if p != "compile"])
    if not job.ar:
        return entry
    bandwidth = entry["machine"]["bandwidth_gb_s"]
    entry["autoregressive"] = autoregressive(m, job, job.ar_paths, bandwidth)
    if job.bf16 and m.device.type == "cpu":
        low, _ = load_model(dataclasses.replace(job.model, dtype="bfloat16"))
        paths = [p for p in job.ar_paths if p in ("hf", "engine")]
        entry["autoregressive_bf16"] = autoregressive(EarlyExitModel(low), job, paths, bandwidth)
        del low
    return entry
