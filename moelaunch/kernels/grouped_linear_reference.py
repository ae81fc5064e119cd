"""Plain-torch twin of the grouped linear kernel (csrc/grouped_linear_cpu.cpp): the same signature and
numerics (fp32 inside, x's dtype out), one GEMM per group. The path wherever the C++ kernel does not run."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from moelaunch.kernels.fused_reference import silu_mul_ref


def per_group(
    linear: Callable[..., Tensor], x: Tensor, offsets: Tensor, *stacks: Tensor, width: int | None = None
) -> Tensor:
    """Rows offsets[g]:offsets[g+1] of x [T, K] through linear(rows, stack[g] for each stack) -> [T, N] in
    x's dtype; N is `width`, by default the first stack's dim 1. The torch path of every grouped kernel."""
    bounds = offsets.tolist()
    if len(bounds) != stacks[0].shape[0] + 1:
        raise RuntimeError("offsets must have one more entry than groups")
    if bounds[0] != 0 or bounds[-1] != x.shape[0]:
        raise RuntimeError("offsets must start at 0 and end at x's row count")
    out = torch.empty(x.shape[0], width or stacks[0].shape[1], dtype=x.dtype, device=x.device)
    for g, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if end > start:
            out[start:end] = linear(x[start:end], *(s[g] for s in stacks))
    return out


def grouped_linear_ref(x: Tensor, weight: Tensor, offsets: Tensor, gated: bool = False) -> Tensor:
    """x [T, K] with group g's rows at offsets[g]:offsets[g+1], weight [G, N, K] -> [T, N]; gated (each
    group's weight [gate; up]): silu(rows @ gate^T) * (rows @ up^T), [T, N / 2]."""

    def product(rows: Tensor, w: Tensor) -> Tensor:
        out = rows.float() @ w.float().T
        return (silu_mul_ref(*out.chunk(2, dim=-1)) if gated else out).to(x.dtype)

    return per_group(product, x, offsets, weight, width=weight.shape[1] // (2 if gated else 1))
