"""Few-row linear layers on the CPU through the C++ kernel in csrc/grouped_linear_cpu.cpp.

Decode multiplies a few rows by large weights: the BLAS GEMM packs each weight before using it, which
costs more than the arithmetic. The kernel reads each weight once, as stored. Rows come in groups, each
with its own weight (routed experts); a plain linear layer is one group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import cpu_extension


def grouped_linear_cpu(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """x [T, K] with group g's rows at offsets[g]:offsets[g+1], weight [G, N, K] fp32 or bf16 -> [T, N].

    Computed in fp32 and returned in x's dtype.
    """
    # Conversions only when needed: at decode sizes even a no-op .to() call is a visible cost.
    x32 = x if x.dtype == torch.float32 else x.float()
    offsets = offsets if offsets.dtype == torch.int64 else offsets.to(torch.int64)
    out = cpu_extension.require().grouped_linear_cpu(
        x32.contiguous(), weight.contiguous(), offsets.contiguous()
    )
    return out if x.dtype == torch.float32 else out.to(x.dtype)
