"""How many cache blocks a rank can afford."""

from __future__ import annotations

import torch


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo: give kv_cache_memory explicitly")


def num_blocks_for(budget_bytes: int, bytes_per_block: int) -> int:
    if budget_bytes < bytes_per_block:
        raise ValueError(
            f"the KV cache budget ({budget_bytes} bytes) is below one block ({bytes_per_block} bytes): "
            "raise kv_cache_memory / kv_cache_fraction or lower block_size"
        )
    return budget_bytes // bytes_per_block
