"""Plain-torch twin of the grouped linear kernel (csrc/grouped_linear_cpu.cpp): the same signature and
numerics (fp32 inside, x's dtype out), one GEMM per group. The path wherever the C++ kernel does not run."""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_linear_ref(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """x [T, K] with group g's rows at offsets[g]:offsets[g+1], weight [G, N, K] -> [T, N]."""
    bounds = offsets.tolist()
    if len(bounds) != weight.shape[0] + 1:
        raise RuntimeError("offsets must have one more entry than groups")
    if bounds[0] != 0 or bounds[-1] != x.shape[0]:
        raise RuntimeError("offsets must start at 0 and end at x's row count")
    out = torch.empty(x.shape[0], weight.shape[1], dtype=torch.float32, device=x.device)
    for g, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if end > start:
            out[start:end] = x[start:end].float() @ weight[g].float().T
    return out.to(x.dtype)
