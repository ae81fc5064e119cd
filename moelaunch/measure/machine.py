"""What a timing ran on: the CPU (or GPU) and how busy the machine was, for a report's header."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    names = (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return next(names, "unknown CPU")


def machine_line(device: str) -> str:
    """e.g. `Intel Xeon ..., 2 cores; load average 3.1 at the start` (a shared machine's timings move with
    its load)."""
    if device == "cuda":
        import torch

        where = torch.cuda.get_device_name(0)
    else:
        where = f"{cpu_name()}, {os.cpu_count()} cores"
    return f"{where}; load average {os.getloadavg()[0]:.1f} at the start"
