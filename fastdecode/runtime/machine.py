"""What machine a measurement was made on, once: the CPU model, the threads, the accelerator.

Speed figures mean something only with the machine beside them (a Xeon at 1 thread is not an EPYC at 2), so
every command that prints or writes a speed figure names it with ``machine_label``; measured costs kept on
disk are keyed by ``machine_key`` (what a timing depends on: processor, cores, accelerator, torch build).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def cpu_name() -> str:
    """The CPU model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def accelerator(device: torch.device | str | None = None) -> str | None:
    """The GPU's name when ``device`` is a CUDA device, else None."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


def machine_label(device: torch.device | str | None = None, threads: int | None = None) -> str:
    """``"AMD EPYC, 1 thread"`` / ``"NVIDIA H100 80GB HBM3 (host AMD EPYC, 16 threads)"``: what a speed
    figure was measured on; ``threads`` defaults to torch's intra-op thread count now."""
    threads = torch.get_num_threads() if threads is None else threads
    cpu = f"{cpu_name()}, {threads} thread{'s' if threads != 1 else ''}"
    gpu = accelerator(device)
    return cpu if gpu is None else f"{gpu} (host {cpu})"


def machine_key(device: torch.device | str | None = None) -> str:
    """What a timing on this machine depends on besides the model and threads: processor, logical cores,
    accelerator and torch build (a file-name-safe string)."""
    parts = [cpu_name(), f"{os.cpu_count()}cores", accelerator(device) or "cpu", torch.__version__]
    return "-".join("".join(c if c.isalnum() or c in "._" else "_" for c in part) for part in parts)
