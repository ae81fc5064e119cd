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


# The instruction sets that decide which kernels run (ours and the peers'), in the order they extend.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def kernel_flags() -> list[str]:
    from moelaunch.kernels.cpu_extension import cpu_flags

    return [f for f in KERNEL_FLAGS if f in cpu_flags()]


def machine_line(device: str) -> str:
    """e.g. `Intel Xeon ..., 2 cores (avx2 avx512f ...); load average 3.1 at the start` (a shared
    machine's timings move with its load)."""
    if device == "cuda":
        import torch

        where = torch.cuda.get_device_name(0)
    else:
        where = f"{cpu_name()}, {os.cpu_count()} cores ({' '.join(kernel_flags()) or 'no AVX2'})"
    return f"{where}; load average {os.getloadavg()[0]:.1f} at the start"
