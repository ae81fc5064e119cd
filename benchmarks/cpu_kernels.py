"""CPU kernel micro-benchmark: the C++ kernels against the torch paths they replace, on one thread.

    python -m benchmarks.cpu_kernels [--threads 1 --repeats 5]

- few-row linear: `kernels.grouped_linear` (one group) against F.linear, for the bench model's
  projection shapes and one 671B-sized one;
- routed experts: the grouped kernel over 16 stacked experts against one F.linear per expert and
  against the zero-padded batched GEMM (`MoE.run_stacked`'s arithmetic); its SiLU-gated form
  (`gated=True`, the gating in its epilogue) against the product followed by `silu_mul`;
- paged MLA decode: the C++ kernel against the torch reference (8 heads, 512 + 64 latent, blocks of
  16, 290 cached tokens per row);
- paged cache stores of 512 + 64 latents: the FP8 cache's quantizing store against `quantize_latent` and
  two index copies, the row store of a bf16 cache against index_copy_ (one layer; warm pools, as a step's
  writes are).

Weights and caches are "cold": each timing walks through enough copies (over 100 MB) that none is in
the CPU cache when its turn comes, as in a decode step that streams the whole model. Each figure is
the best of --repeats passes. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moelaunch import kernels
from moelaunch.kernels import mla_decode_reference, paged_store
from moelaunch.kernels.cpu_ops import cpu_kernel

COLD_BYTES = 100 * 2**20


def _copies(make: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    first = make()
    return [first] + [make() for _ in range(max(1, COLD_BYTES // (first.numel() * first.element_size())))]


def _best_ms(fn: Callable[[torch.Tensor], object], operands: list[torch.Tensor], repeats: int) -> float:
    """Best-of-`repeats` mean time of fn over every operand copy, in ms."""
    fn(operands[0])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for op in operands:
            fn(op)
        best = min(best, (time.perf_counter() - start) / len(operands))
    return best * 1e3


def linear_rows(repeats: int) -> list[dict]:
    results = []
    for k, n in [(256, 1024), (256, 576), (512, 256), (256, 4096), (7168, 512)]:
        weights = _copies(lambda n=n, k=k: torch.randn(n, k))
        for rows in (1, 2, 4, 8, 16, 32, 64):
            x = torch.randn(rows, k)
            offsets = torch.tensor([0, rows])
            blas = _best_ms(lambda w, x=x: F.linear(x, w), weights, repeats)
            ours = _best_ms(lambda w, x=x, o=offsets: kernels.grouped_linear(x, w[None], o), weights, repeats)
            results.append({"k": k, "n": n, "rows": rows, "F.linear_ms": blas, "kernel_ms": ours})
    return results


def experts(repeats: int) -> list[dict]:
    n_experts, inter, hidden = 16, 512, 256  # the bench model's stacked [gate; up] weights
    stacks = _copies(lambda: torch.randn(n_experts, inter, hidden))
    results = []
    for rows in (1, 2, 4, 16, 32):
        x = torch.randn(n_experts * rows, hidden)
        offsets = torch.arange(n_experts + 1) * rows
        padded = x.view(n_experts, rows, hidden)
        per_expert = _best_ms(
            lambda s, x=x, r=rows: [F.linear(x[e * r : (e + 1) * r], s[e]) for e in range(len(s))],
            stacks,
            repeats,
        )
        batched = _best_ms(lambda s, p=padded: torch.bmm(p, s.transpose(1, 2)), stacks, repeats)
        ours = _best_ms(lambda s, x=x, o=offsets: kernels.grouped_linear(x, s, o), stacks, repeats)
        two_passes = _best_ms(
            lambda s, x=x, o=offsets: kernels.silu_mul(*kernels.grouped_linear(x, s, o).chunk(2, dim=-1)),
            stacks,
            repeats,
        )
        gated = _best_ms(
            lambda s, x=x, o=offsets: kernels.grouped_linear(x, s, o, gated=True), stacks, repeats
        )
        results.append(
            {"rows_per_expert": rows, "per_expert_ms": per_expert, "bmm_ms": batched, "kernel_ms": ours,
             "kernel_then_silu_mul_ms": two_passes, "gated_kernel_ms": gated}
        )  # fmt: skip
    return results


def decode(repeats: int) -> list[dict]:
    heads, c_dim, p_dim, block, length = 8, 512, 64, 16, 290
    blocks_per_row = -(-length // block)
    results = []
    for rows in (8, 64):
        pool = 2 * rows * blocks_per_row
        caches = _copies(lambda pool=pool: torch.randn(pool, block, c_dim + p_dim))
        table = torch.randperm(pool)[: rows * blocks_per_row].to(torch.int32).view(rows, blocks_per_row)
        q_latent, q_pe = torch.randn(rows, heads, c_dim), torch.randn(rows, heads, p_dim)
        lens = torch.full((rows,), length)
        args = (q_latent, q_pe, table, lens)

        def reference(c: torch.Tensor, a: tuple = args) -> torch.Tensor:
            return mla_decode_reference.paged_mla_decode_ref(a[0], a[1], c, a[2], a[3], 0.05)

        def kernel(c: torch.Tensor, a: tuple = args) -> torch.Tensor:
            return kernels.paged_mla_decode(a[0], a[1], c, a[2], a[3], 0.05)

        ref, ours = _best_ms(reference, caches, repeats), _best_ms(kernel, caches, repeats)
        results.append({"rows": rows, "cached_tokens": length, "reference_ms": ref, "kernel_ms": ours})
    return results


def _store_times(rows: int, repeats: int) -> dict:
    c_dim, width, block = 512, 576, 16
    blocks = -(-rows // block) + 1
    fp8_pool = torch.zeros(1, blocks, block, width, dtype=kernels.FP8_KV_DTYPE)
    scales = torch.zeros(1, blocks, block, 2)
    bf16_pool = torch.zeros(1, blocks, block, width, dtype=torch.bfloat16)
    slots = torch.randperm(blocks * block)[:rows]
    latent = [torch.randn(rows, width)]

    def fp8_torch(x: torch.Tensor) -> None:
        values, token_scales = kernels.quantize_latent(x, c_dim)
        paged_store._store(fp8_pool, 0, slots, values)
        paged_store._store(scales, 0, slots, token_scales)

    def fp8_kernel(x: torch.Tensor) -> None:
        kernels.store_fp8_latent(fp8_pool, scales, 0, slots, x, c_dim)

    def row_torch(x: torch.Tensor) -> None:
        paged_store._store(bf16_pool, 0, slots, x)

    def row_kernel(x: torch.Tensor) -> None:
        cpu_kernel("store_rows_cpu")(bf16_pool, 0, slots, x)

    bf16_rows = [latent[0].bfloat16()]
    return {
        "rows": rows,
        "fp8_torch_ms": _best_ms(fp8_torch, latent, repeats),
        "fp8_kernel_ms": _best_ms(fp8_kernel, latent, repeats),
        "row_index_copy_ms": _best_ms(row_torch, bf16_rows, repeats),
        "row_kernel_ms": _best_ms(row_kernel, bf16_rows, repeats),
    }


def cache_stores(repeats: int) -> list[dict]:
    # Decode at batch 1 and 8; a batch-8 prompt step of 256 tokens.
    return [_store_times(rows, repeats) for rows in (1, 8, 2048)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    if not kernels.prepare_cpu_kernels():
        raise SystemExit(
            "the CPU kernels are not built (MOELAUNCH_CPU_KERNELS=0 or no compiler): nothing to compare"
        )
    with torch.no_grad():
        report = {
            "linear": linear_rows(opts.repeats),
            "experts": experts(opts.repeats),
            "decode": decode(opts.repeats),
            "stores": cache_stores(opts.repeats),
        }
    print("few-row linear, cold weights (ms; GB/s of weight streamed)")
    for r in report["linear"]:
        gb = r["k"] * r["n"] * 4 / 1e6
        print(
            f"  K={r['k']:5d} N={r['n']:5d} rows={r['rows']:3d}  F.linear {r['F.linear_ms']:7.3f} "
            f"({gb / r['F.linear_ms']:5.1f})  kernel {r['kernel_ms']:7.3f} ({gb / r['kernel_ms']:5.1f})"
        )
    print("16 experts [gate; up] 512x256, cold (ms)")
    for r in report["experts"]:
        print(
            f"  rows/expert={r['rows_per_expert']:3d}  per-expert F.linear {r['per_expert_ms']:7.3f}  "
            f"padded bmm {r['bmm_ms']:7.3f}  kernel {r['kernel_ms']:7.3f}  "
            f"+silu_mul {r['kernel_then_silu_mul_ms']:7.3f}  gated {r['gated_kernel_ms']:7.3f}"
        )
    print("paged MLA decode, one layer, cold cache (ms)")
    for r in report["decode"]:
        print(f"  rows={r['rows']:3d}  reference {r['reference_ms']:8.3f}  kernel {r['kernel_ms']:7.3f}")
    print("paged cache stores, one layer, 512 + 64 latents (ms)")
    for r in report["stores"]:
        print(
            f"  rows={r['rows']:5d}  fp8: torch {r['fp8_torch_ms']:7.4f}  kernel {r['fp8_kernel_ms']:7.4f}  "
            f"bf16 rows: index_copy_ {r['row_index_copy_ms']:7.4f}  kernel {r['row_kernel_ms']:7.4f}"
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
