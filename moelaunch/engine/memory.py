"""How many cache blocks a rank can afford."""

from __future__ import annotations

import os

import torch


def available_bytes(device: torch.device) -> int:
    """Free memory this rank may plan with: its GPU's, or its share of the host's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # CPU ranks of a node share its RAM
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // ranks_here
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo: give kv_cache_memory explicitly")


def num_blocks_for(budget_bytes: int, bytes_per_block: int) -> int:
    if budget_bytes < bytes_per_block:
        raise ValueError(
            f"the KV cache budget ({budget_bytes} bytes) is below one block ({bytes_per_block} bytes): "
            "raise kv_cache_memory / kv_cache_fraction or lower block_size"
        )
    return budget_bytes // bytes_per_block
