"""Plain-torch twin of the grouped linear kernel (csrc/grouped_linear_cpu.cpp): the same signature and
numerics (fp32 inside, x's dtype out), one GEMM per group. The path wherever the C++ kernel does not run."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def per_group(linear: Callable[..., Tensor], x: Tensor, offsets: Tensor, *stacks: Tensor) -> Tensor:
    """Rows offsets[g]:offsets[g+1] of x [T, K] through linear(rows, stack[g] for each stack) -> [T, N] in
    x's dtype; N is the first stack's dim 1. The torch path of every grouped kernel."""
    bounds = offsets.tolist()
    if len(bounds) != stacks[0].shape[0] + 1:
        raise RuntimeError("offsets must have one more entry than groups")
    if bounds[0] != 0 or bounds[-1] != x.shape[0]:
        raise RuntimeError("offsets must start at 0 and end at x's row count")
    out = torch.empty(x.shape[0], stacks[0].shape[1], dtype=x.dtype, device=x.device)
    for g, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if end > start:
            out[start:end] = linear(x[start:end], *(s[g] for s in stacks))
    return out


def grouped_linear_ref(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """x [T, K] with group g's rows at offsets[g]:offsets[g+1], weight [G, N, K] -> [T, N]."""
    return per_group(lambda rows, w: (rows.float() @ w.float().T).to(x.dtype), x, offsets, weight)
