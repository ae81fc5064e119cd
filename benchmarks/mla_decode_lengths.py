"""Paged MLA decode on the CPU by cached length: per call, per sequence, and the cache bytes it streams
per second, on one thread, bf16 queries and cache (the bench model's attention: 8 heads, 512 + 64
latent, blocks of 16, each sequence's blocks scattered over the pool).

    python -m benchmarks.mla_decode_lengths [--batch 64] [--lengths 32,96,256,1024] [--repeats 30]

Per length, the median (min-max) of the repeats, after 5 untimed calls. The per-sequence time splits
into a fixed part (the short lengths) and the cache stream (the long ones).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moelaunch import kernels

HEADS, LATENT, ROPE, BLOCK = 8, 512, 64, 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lengths", default="32,96,256,1024")
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"batch {a.batch}: length, ms per call median (min-max), us per sequence, cache GB/s")
    for length in map(int, a.lengths.split(",")):
        blocks = -(-length // BLOCK)
        pool = a.batch * blocks
        cache = (torch.randn(pool, BLOCK, LATENT + ROPE) * 0.5).bfloat16()
        table = torch.randperm(pool).view(a.batch, blocks)
        lens = torch.full((a.batch,), length)
        q = torch.randn(a.batch, HEADS, LATENT).bfloat16()
        pe = torch.randn(a.batch, HEADS, ROPE).bfloat16()
        times = []
        with torch.inference_mode():
            for i in range(5 + a.repeats):
                start = time.perf_counter()
                kernels.paged_mla_decode(q, pe, cache, table, lens, 0.1)
                if i >= 5:
                    times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times)
        gb_s = a.batch * length * (LATENT + ROPE) * 2 / ms / 1e6
        print(
            f"{length:>6} {ms:.3f} ({min(times):.3f}-{max(times):.3f}) ms  "
            f"{ms * 1e3 / a.batch:.2f} us  {gb_s:.1f} GB/s"
        )


if __name__ == "__main__":
    main()
