"""CUDA graphs of the static decode step: each bucket's step (per variant: greedy, sampled) captured
once over its device buffer, all in one memory pool, replayed per decode step (batches above the
largest bucket stay eager).

Only runs on CUDA devices; no GPU was available where this was written, so it is untested.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

WARMUP_RUNS = 2  # eager runs before capture: lazy set-up (kernel choice, allocator) off the graph


def capture(
    step: Callable[[torch.Tensor, str], torch.Tensor],
    buffers: dict[int, torch.Tensor],
    variants: tuple[str, ...],
    device: torch.device,
) -> Callable[[int, str], torch.Tensor]:
    """Capture `step(buffer, variant)` over each bucket's buffer (largest first, so smaller ones reuse
    its pool memory); returns replay(bucket, variant) -> that graph's output tensor, refreshed. Logs
    capture time and memory."""
    if device.type != "cuda":
        raise RuntimeError(f"CUDA graphs need a CUDA device, not {device}")
    graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    pool = None
    free_before = torch.cuda.mem_get_info(device)[0]
    started = time.monotonic()
    side = torch.cuda.Stream(device)
    for bucket in sorted(buffers, reverse=True):
        buf = buffers[bucket]  # valid inputs for warm-up and capture (every row padding)
        for variant in variants:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(WARMUP_RUNS):
                    step(buf, variant)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                out = step(buf, variant)
            pool = graph.pool()
            graphs[bucket, variant] = (graph, out)
    torch.cuda.synchronize(device)
    used = free_before - torch.cuda.mem_get_info(device)[0]
    print(
        f"moelaunch: captured {len(graphs)} decode CUDA graphs (batch {min(buffers)}..{max(buffers)}) "
        f"in {time.monotonic() - started:.1f} s, {used / 2**20:.0f} MiB",
        file=sys.stderr,
    )

    def replay(bucket: int, variant: str) -> torch.Tensor:
        graph, out = graphs[bucket, variant]
        graph.replay()
        return out

    return replay
