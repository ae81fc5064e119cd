"""bf16 products in the C++ kernels (AMX tiles, vdpbf16ps) against their widening fp32 path, and the
few-row linear against oneDNN's bf16 GEMM, on one thread.

    python -m benchmarks.bf16_kernels [--repeats 5]

bf16 rows and weights (a model running in bf16), each kernel forced (MOELAUNCH_CPU_ISA) onto each bf16
path the CPU has: `amx` (the tiles: csrc/grouped_linear_amx.h, csrc/mla_decode_amx.h), `avx512_bf16`
(vdpbf16ps) and `avx512`, which widens bf16 to fp32 and runs fp32 FMAs:
- routed experts: 16 stacked experts, [gate; up] 512x256 (gated epilogue and plain) and down 256x256,
  1 to 16 rows per expert (batch 64 with top-4 of 16 gives 16), the kernel called on each path as
  forced (the wrapper sends fewer than AMX_MIN_ROWS_PER_GROUP rows per expert to vdpbf16ps);
- few-row linear: one group, the bench model's projection shapes, 1 to 128 rows, through
  `kernels.linear` (which takes oneDNN past its row limit) and `onednn`: F.linear itself;
- paged MLA decode: 8 heads, 512 + 64 latent, blocks of 16, 290 cached tokens per row, bf16 cache.

Cold operands as in `benchmarks.cpu_kernels`. Each repeat times every variant in turn over every copy;
figures are the median (min-max) of the repeats' per-call means, in ms, and xN the last variant's median
over each one's. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.cpu_kernels import _copies
from moelaunch import kernels
from moelaunch.kernels import selection
from moelaunch.kernels.cpu_ops import cpu_kernel

DOT_PATHS = ("avx512_bf16", "avx512")
# A variant that is not a kernel path: oneDNN's bf16 GEMM (F.linear), timed beside the paths.
ONEDNN = "onednn"


def _pass_ms(fn: Callable[[torch.Tensor], object], operands: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for op in operands:
        fn(op)
    return (time.perf_counter() - start) / len(operands) * 1e3


def _set_path(path: str | None) -> None:
    if path is None:
        os.environ.pop("MOELAUNCH_CPU_ISA", None)
    else:
        os.environ["MOELAUNCH_CPU_ISA"] = path
    selection.cpu_isa_path.cache_clear()


def compare(
    fn: Callable[[torch.Tensor], object],
    operands: list[torch.Tensor],
    repeats: int,
    paths: tuple[str, ...],
    onednn: Callable[[torch.Tensor], object] | None = None,
) -> dict:
    """fn's time on each path (and `onednn`'s, under ONEDNN), alternating pass by pass."""
    variants = [(path, fn) for path in paths] + ([(ONEDNN, onednn)] if onednn else [])
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(repeats):
        for name, run in variants:
            _set_path(None if name == ONEDNN else name)
            run(operands[0])
            times[name].append(_pass_ms(run, operands))
    _set_path(None)
    return {path: {"median": statistics.median(t), "min": min(t), "max": max(t)} for path, t in times.items()}


def experts(repeats: int, paths: tuple[str, ...]) -> list[dict]:
    n_experts = 16
    results = []
    for name, n, k, gated in (
        ("gate_up", 512, 256, True),
        ("gate_up", 512, 256, False),
        ("down", 256, 256, False),
    ):
        stacks = _copies(lambda n=n, k=k: torch.randn(n_experts, n, k).bfloat16())
        for rows in (1, 2, 4, 16):
            x = torch.randn(n_experts * rows, k).bfloat16()
            offsets = torch.arange(n_experts + 1) * rows
            fn = lambda s, x=x, o=offsets, g=gated: cpu_kernel("grouped_linear_cpu")(  # noqa: E731
                x, s, o, g, selection.cpu_isa_path()
            )
            results.append(
                {
                    "weight": name,
                    "gated": gated,
                    "rows_per_expert": rows,
                    **compare(fn, stacks, repeats, paths),
                }
            )
    return results


def linear_rows(repeats: int, paths: tuple[str, ...]) -> list[dict]:
    results = []
    for k, n in [(256, 1024), (256, 576), (512, 256), (512, 4096)]:
        weights = _copies(lambda n=n, k=k: torch.randn(n, k).bfloat16())
        for rows in (1, 8, 32, 64, 128):
            x = torch.randn(rows, k).bfloat16()
            fn = lambda w, x=x: kernels.linear(x, w)  # noqa: E731
            onednn = lambda w, x=x: torch.nn.functional.linear(x, w)  # noqa: E731
            results.append({"k": k, "n": n, "rows": rows, **compare(fn, weights, repeats, paths, onednn)})
    return results


def decode(repeats: int, paths: tuple[str, ...]) -> list[dict]:
    heads, c_dim, p_dim, block, length = 8, 512, 64, 16, 290
    blocks_per_row = -(-length // block)
    results = []
    for rows in (8, 64):
        pool = 2 * rows * blocks_per_row
        caches = _copies(lambda pool=pool: torch.randn(pool, block, c_dim + p_dim).bfloat16())
        table = torch.randperm(pool)[: rows * blocks_per_row].to(torch.int32).view(rows, blocks_per_row)
        q_latent, q_pe = (
            torch.randn(rows, heads, c_dim).bfloat16(),
            torch.randn(rows, heads, p_dim).bfloat16(),
        )
        lens = torch.full((rows,), length)
        args = (q_latent, q_pe, table, lens)

        def fn(c: torch.Tensor, a: tuple = args) -> torch.Tensor:
            return kernels.paged_mla_decode(a[0], a[1], c, a[2], a[3], 0.05)

        results.append({"rows": rows, "cached_tokens": length, **compare(fn, caches, repeats, paths)})
    return results


def _cells(row: dict, names: tuple[str, ...]) -> str:
    """Each variant's median (min-max) and the last variant's median over it."""
    last = row[names[-1]]["median"]
    return "  ".join(
        f"{name} {row[name]['median']:7.3f} ({row[name]['min']:.3f}-{row[name]['max']:.3f})"
        + (f" x{last / row[name]['median']:.2f}" if name != names[-1] else "")
        for name in names
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    if not kernels.prepare_cpu_kernels():
        raise SystemExit("the CPU kernels are not built (MOELAUNCH_CPU_KERNELS=0 or no compiler)")
    best = selection.CPU_ISA_PATHS[selection.cpu_isa_path()]
    if best not in ("avx512_bf16", "amx"):
        raise SystemExit(f"this CPU's best kernel path is {best}: no bf16 dot products to compare")
    paths = ("amx", *DOT_PATHS) if best == "amx" else DOT_PATHS
    with torch.no_grad():
        report = {
            "experts": experts(opts.repeats, paths),
            "linear": linear_rows(opts.repeats, paths),
            "decode": decode(opts.repeats, paths),
        }
    print(f"load average {os.getloadavg()[0]:.2f}; ms per call, median (min-max) of {opts.repeats}")
    print("16 experts, bf16 rows and weights")
    for r in report["experts"]:
        shape = f"{r['weight']:8s} gated={r['gated']!s:5s} rows/expert={r['rows_per_expert']:3d}"
        print(f"  {shape}  {_cells(r, paths)}")
    print("few-row linear, bf16 (kernels.linear on each path; xN: oneDNN's time over it)")
    for r in report["linear"]:
        print(f"  K={r['k']:4d} N={r['n']:5d} rows={r['rows']:3d}  {_cells(r, (*paths, ONEDNN))}")
    print("paged MLA decode, one layer, bf16 queries and cache")
    for r in report["decode"]:
        print(f"  rows={r['rows']:3d}  {_cells(r, paths)}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
