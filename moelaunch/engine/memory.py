"""Memory: what this machine has free to plan with, what this process holds (now and at its peak), and
how many cache blocks a rank can afford. Host figures come from Linux's /proc, in bytes."""

from __future__ import annotations

import os

import torch


def _proc_fields(path: str, *names: str) -> dict[str, int]:
    """The `Name: N kB` lines of a /proc file, in bytes."""
    found = {}
    with open(path) as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in names:
                found[name] = int(value.split()[0]) * 1024
    if missing := [n for n in names if n not in found]:
        raise RuntimeError(f"{path} has no {', '.join(missing)}")
    return found


def available_bytes(device: torch.device) -> int:
    """Free memory this rank may plan with: its GPU's, or its share of the host's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # CPU ranks of a node share its RAM
    try:
        return _proc_fields("/proc/meminfo", "MemAvailable")["MemAvailable"] // ranks_here
    except RuntimeError:
        raise RuntimeError(
            "cannot read MemAvailable from /proc/meminfo: give kv_cache_memory explicitly"
        ) from None


def process_memory(*fields: str) -> dict[str, int]:
    """This process's `fields` of /proc/self/status in bytes: VmRSS (resident now), VmHWM (the resident
    peak since the process started or `reset_peak_rss`), RssAnon and RssFile (VmRSS's anonymous and
    file-backed parts)."""
    return _proc_fields("/proc/self/status", *fields)


def rss_bytes() -> int:
    return process_memory("VmRSS")["VmRSS"]


def peak_rss_bytes() -> int:
    return process_memory("VmHWM")["VmHWM"]


def reset_peak_rss() -> bool:
    """Restart VmHWM at the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def num_blocks_for(budget_bytes: int, bytes_per_block: int) -> int:
    if budget_bytes < bytes_per_block:
        raise ValueError(
            f"the KV cache budget ({budget_bytes} bytes) is below one block ({bytes_per_block} bytes): "
            "raise kv_cache_memory / kv_cache_fraction or lower block_size"
        )
    return budget_bytes // bytes_per_block
