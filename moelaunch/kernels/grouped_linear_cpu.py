"""Few-row linear layers on the CPU through the C++ kernel in csrc/grouped_linear_cpu.cpp.

Decode multiplies a few rows by large weights: the BLAS GEMM packs each weight before using it, which
costs more than the arithmetic. The kernel reads each weight once, as stored. Rows come in groups, each
with its own weight (routed experts); a plain linear layer is one group. bf16 rows against a bf16 weight
multiply in bf16 pairs (vdpbf16ps, fp32 sums) on a CPU with AVX512-BF16, through the AMX tiles on one with
AMX-BF16 from a few rows per group, unless MOELAUNCH_CPU_ISA forces a lower path; there fp32 rows meeting
several bf16 weights (experts, heads), or one through the tiles, are rounded to bf16 first. Other rows
are computed in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelaunch.kernels.cpu_extension import cast_if_needed
from moelaunch.kernels.cpu_ops import cpu_kernel
from moelaunch.kernels.fused import silu_mul
from moelaunch.kernels.selection import (
    CPU_ISA_PATHS,
    amx_tiles,
    amx_tiles_fit,
    bf16_dot_products,
    kernel_isa_path,
)

# Rows per group (on average) up to which SiLU gating runs in the kernel's epilogue: measured faster than
# a second pass at 1-2 rows per group, slower from 4 (benchmarks/cpu_kernels.py; docs/benchmarks.md,
# issue 29). Decode's routed experts get 1-2 rows each; a batch's shared experts, one group, get more.
GATED_EPILOGUE_MAX_ROWS = 2
# Rows per group (on average) from which the AMX tiles beat vdpbf16ps: a tile multiply makes 16 x 16 sums,
# wasted below a few rows; measured 0.8-0.95x at 1-2 rows, 1.3-4.4x from 4 (benchmarks/bf16_kernels.py).
# Their SiLU epilogue costs nothing extra at any count. Below it the call is sent to the vdpbf16ps path.
AMX_MIN_ROWS_PER_GROUP = 3
_BF16_DOT_PATH = CPU_ISA_PATHS.index("avx512_bf16")


def grouped_linear_cpu(x: Tensor, weight: Tensor, offsets: Tensor, gated: bool = False) -> Tensor:
    """x [T, K] with group g's rows at offsets[g]:offsets[g+1], weight [G, N, K] fp32 or bf16 -> [T, N];
    gated (each group's weight [gate; up]): silu(gate product) * up product, [T, N / 2], the SiLU in the
    kernel's epilogue.

    Summed in fp32 and returned in x's dtype (bf16 rows go in as they are: the kernel widens them, or
    multiplies them in bf16 pairs or tiles with a bf16 weight).
    """
    groups, n, _ = weight.shape
    tiles = x.shape[0] >= AMX_MIN_ROWS_PER_GROUP * groups and amx_tiles_fit(weight, n // 2 if gated else n)
    epilogue = gated and (tiles or x.shape[0] <= GATED_EPILOGUE_MAX_ROWS * groups)
    if tiles:
        rows, path = x, kernel_isa_path()  # the tiles round fp32 rows to bf16 as they pack them
    else:
        # fp32 rows are rounded only for several groups (routed experts, the decode heads' per-head
        # products): 1.0-1.4x there, while a single weight's few rows lost up to 8 % in bf16 pairs
        # (benchmarks/bf16_kernels.py).
        grouped = groups > 1 and weight.dtype == torch.bfloat16
        in_bf16 = x.dtype == torch.bfloat16 or (grouped and bf16_dot_products())
        rows = cast_if_needed(x, torch.bfloat16 if in_bf16 else torch.float32)
        path = _BF16_DOT_PATH if amx_tiles() else kernel_isa_path()  # too few rows for the tiles
    out = cpu_kernel("grouped_linear_cpu")(
        rows.contiguous(),
        weight.contiguous(),
        cast_if_needed(offsets, torch.int64).contiguous(),
        epilogue,
        path,
    )
    if gated and not epilogue:
        out = silu_mul(*out.chunk(2, dim=-1))
    return cast_if_needed(out, x.dtype)


def per_head_tiles_take(x: Tensor, stack: Tensor) -> bool:
    """Whether the AMX tiles multiply x [R, H, K] by stack [H, N, K] per head, in place (rows with unit
    stride, fp32 or bf16): as `grouped_linear_cpu` would for the same rows grouped by head."""
    return (
        x.shape[0] >= AMX_MIN_ROWS_PER_GROUP and x.stride(-1) == 1
        and x.dtype in (torch.float32, torch.bfloat16) and stack.is_contiguous()
        and amx_tiles_fit(stack, stack.shape[1])
    )  # fmt: skip


def per_head_linear_cpu(x: Tensor, stack: Tensor) -> Tensor:
    """x [R, H, K] times stack[h]^T for each head h -> [R, H, N] in x's dtype, through the AMX tiles (ask
    `per_head_tiles_take` first): fp32 sums, fp32 rows rounded to bf16 as they are packed."""
    out = cpu_kernel("per_head_linear_cpu")(x, stack, kernel_isa_path())
    return cast_if_needed(out, x.dtype)
