"""Integer-weight and FP8-cache CPU kernels against the float kernels and the torch paths, on one thread.

    python -m benchmarks.int_kernels [--repeats 5]

- few-row linear: the C++ INT8 / W8A8 / INT4 kernels (the CPU's best instruction-set path, and the
  AVX2 fallback where the CPU has more) against the float grouped-linear kernel on fp32 and bf16
  weights, and against the torch reference that dequantizes the weight on every call;
- paged MLA decode over an FP8 cache (dequantized in the kernel) against the same kernel over fp32 and
  bf16 caches.

Cold operands as in `benchmarks.cpu_kernels` (over 100 MB of copies per timing). Prints a table and
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch

from benchmarks.cpu_kernels import _best_ms, _copies
from moelaunch import kernels
from moelaunch.kernels import selection


def _forced(path: str, measure: Callable[[], float]) -> float:
    """measure() with the integer kernels forced onto `path` (MOELAUNCH_CPU_ISA), then back."""
    os.environ["MOELAUNCH_CPU_ISA"] = path
    selection.cpu_isa_path.cache_clear()
    try:
        return measure()
    finally:
        del os.environ["MOELAUNCH_CPU_ISA"]
        selection.cpu_isa_path.cache_clear()


def _linear_row(x: torch.Tensor, weights: dict[str, list], repeats: int, best: str) -> dict[str, float]:
    """Every method's time on rows x against its copies of one weight (ms)."""
    offsets = torch.tensor([0, x.shape[0]])
    int8, int4 = weights["int8"], weights["int4"]
    row = {
        "fp32_ms": _best_ms(lambda w: kernels.grouped_linear(x, w[None], offsets), weights["fp32"], repeats),
        "bf16_ms": _best_ms(lambda w: kernels.grouped_linear(x, w[None], offsets), weights["bf16"], repeats),
        "int8_torch_ms": _best_ms(lambda qs: kernels.int8_dequant(*qs) @ x.T, int8, repeats),
        "int8_ms": _best_ms(lambda qs: kernels.int8_linear(x, *qs), int8, repeats),
        "w8a8_ms": _best_ms(lambda qs: kernels.w8a8_linear(x, *qs), int8, repeats),
        "int4_ms": _best_ms(lambda p: kernels.int4_linear(x, *p, kernels.INT4_GROUP_SIZE), int4, repeats),
    }
    if best in ("avx512", "avx512_bf16", "amx"):
        int8_avx2 = lambda: _best_ms(lambda qs: kernels.int8_linear(x, *qs), int8, repeats)  # noqa: E731
        row["int8_avx2_ms"] = _forced("avx2", int8_avx2)
    return row


def linear_rows(repeats: int) -> list[dict]:
    best = selection.CPU_ISA_PATHS[selection.cpu_isa_path()]
    results = []
    for k, n in [(256, 1024), (512, 256), (7168, 512)]:
        dense = _copies(lambda n=n, k=k: torch.randn(n, k))
        weights = {
            "fp32": dense,
            "bf16": [w.bfloat16() for w in dense],
            "int8": [kernels.int8_weight_quant(w) for w in dense],
            "int4": [kernels.int4_weight_quant(w) for w in dense],
        }
        for rows in (1, 8, 32, 64):
            row = _linear_row(torch.randn(rows, k), weights, repeats, best)
            results.append({"k": k, "n": n, "rows": rows, "path": best, **row})
    return results


def _decode_row(rows: int, repeats: int) -> dict:
    heads, c_dim, p_dim, block, length = 8, 512, 64, 16, 290
    blocks_per_row = -(-length // block)
    pool = 2 * rows * blocks_per_row
    table = torch.randperm(pool)[: rows * blocks_per_row].to(torch.int32).view(rows, blocks_per_row)
    q_latent, q_pe = torch.randn(rows, heads, c_dim), torch.randn(rows, heads, p_dim)
    lens = torch.full((rows,), length)
    fp32 = _copies(lambda: torch.randn(pool, block, c_dim + p_dim))
    bf16 = [c.bfloat16() for c in fp32]
    fp8 = [kernels.quantize_latent(c, c_dim) for c in fp32]

    def run(cache: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.paged_mla_decode(q_latent, q_pe, cache, table, lens, 0.05, scales)

    return {
        "rows": rows,
        "cached_tokens": length,
        "fp32_cache_ms": _best_ms(run, fp32, repeats),
        "bf16_cache_ms": _best_ms(run, bf16, repeats),
        "fp8_cache_ms": _best_ms(lambda vs: run(*vs), fp8, repeats),
    }


def fp8_decode(repeats: int) -> list[dict]:
    return [_decode_row(rows, repeats) for rows in (8, 64)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.prepare_cpu_kernels():
        raise SystemExit("the CPU kernels did not build: nothing to measure")
    report = {"linear": linear_rows(args.repeats), "mla_decode": fp8_decode(args.repeats)}
    print("few-row linear, cold weights (ms)")
    for r in report["linear"]:
        cells = "  ".join(f"{key[:-3]} {value:.4f}" for key, value in r.items() if key.endswith("_ms"))
        print(f"  K={r['k']:5d} N={r['n']:5d} rows={r['rows']:2d}  {cells}")
    print("paged MLA decode, one layer, cold cache (ms)")
    for r in report["mla_decode"]:
        cells = "  ".join(f"{key[:-3]} {value:.3f}" for key, value in r.items() if key.endswith("_ms"))
        print(f"  rows={r['rows']:3d}  {cells}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
