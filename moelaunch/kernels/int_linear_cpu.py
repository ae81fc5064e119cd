"""Integer-weight linear layers on the CPU through the C++ kernels in csrc/int_linear_cpu.cpp, which read
INT8 and packed INT4 weights as stored (the torch references dequantize the whole weight on every call).

Every function takes rows grouped by `offsets` against a stack of weights [G, N, ...] (routed experts; a
plain projection is one group), computes in fp32 and returns x's dtype. The instruction-set path is
`selection.cpu_isa_path()`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelaunch.kernels.cpu_extension import cast_if_needed
from moelaunch.kernels.cpu_ops import cpu_kernel
from moelaunch.kernels.selection import kernel_isa_path


def _rows(x: Tensor) -> Tensor:
    return cast_if_needed(x, torch.float32).contiguous()


def int8_linear_cpu(x: Tensor, q: Tensor, scale: Tensor, offsets: Tensor) -> Tensor:
    """x [T, K], q int8 [G, N, K], scale fp32 [G, N] -> x @ (q * scale)^T per group, [T, N]."""
    out = cpu_kernel("int8_linear_cpu")(
        _rows(x), q.contiguous(), scale.contiguous(), offsets.contiguous(), kernel_isa_path()
    )
    return cast_if_needed(out, x.dtype)


def w8a8_linear_cpu(
    x: Tensor, q: Tensor, scale: Tensor, offsets: Tensor, row_amax: Tensor | None = None
) -> Tensor:
    """As int8_linear_cpu with x quantized to int8 per row first and int32 dot products (W8A8);
    row_amax [T]: each row's amax to quantize with, instead of its own."""
    out = cpu_kernel("w8a8_linear_cpu")(
        _rows(x), q.contiguous(), scale.contiguous(), offsets.contiguous(), kernel_isa_path(), row_amax
    )
    return cast_if_needed(out, x.dtype)


def int4_linear_cpu(
    x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, offsets: Tensor, group_size: int
) -> Tensor:
    """x [T, K], packed uint8 [G, N, K/2], scale fp32 / zero uint8 [G, N, ceil(K / group_size)] -> [T, N]."""
    out = cpu_kernel("int4_linear_cpu")(
        _rows(x),
        packed.contiguous(),
        scale.contiguous(),
        zero.contiguous(),
        offsets.contiguous(),
        group_size,
        kernel_isa_path(),
    )
    return cast_if_needed(out, x.dtype)
