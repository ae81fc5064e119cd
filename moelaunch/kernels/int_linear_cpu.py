"""Integer-weight linear layers on the CPU through the C++ kernels in csrc/int_linear_cpu.cpp, which read
INT8 and packed INT4 weights as stored (the torch references dequantize the whole weight on every call).

Every function takes rows grouped by `offsets` against a stack of weights [G, N, ...] (routed experts; a
plain projection is one group), x in fp32 or bf16, and returns x's dtype; `gated` ([gate; up] stacks)
returns silu(gate) * up, [T, N / 2]. The products are integer ones (x's rows as 16-bit codes for the
weight-only methods, int8 for W8A8: the file's header). The instruction-set path is
`selection.cpu_isa_path()`.
"""

from __future__ import annotations

from torch import Tensor

from moelaunch.kernels.cpu_ops import cpu_kernel
from moelaunch.kernels.selection import kernel_isa_path


def int8_linear_cpu(x: Tensor, q: Tensor, scale: Tensor, offsets: Tensor, gated: bool = False) -> Tensor:
    """x [T, K], q int8 [G, N, K], scale fp32 [G, N] -> x @ (q * scale)^T per group, [T, N]."""
    return cpu_kernel("int8_linear_cpu")(
        x.contiguous(), q.contiguous(), scale.contiguous(), offsets.contiguous(), gated, kernel_isa_path()
    )


def w8a8_linear_cpu(
    x: Tensor,
    q: Tensor,
    scale: Tensor,
    offsets: Tensor,
    gated: bool = False,
    row_amax: Tensor | None = None,
) -> Tensor:
    """As int8_linear_cpu with x quantized to int8 per row (W8A8); row_amax [T]: each row's amax to
    quantize with, instead of its own."""
    return cpu_kernel("w8a8_linear_cpu")(
        x.contiguous(),
        q.contiguous(),
        scale.contiguous(),
        offsets.contiguous(),
        gated,
        kernel_isa_path(),
        row_amax,
    )


def int4_linear_cpu(
    x: Tensor,
    packed: Tensor,
    scale: Tensor,
    zero: Tensor,
    offsets: Tensor,
    group_size: int,
    gated: bool = False,
) -> Tensor:
    """x [T, K], packed uint8 [G, N, K/2], scale fp32 / zero uint8 [G, N, ceil(K / group_size)] -> [T, N]."""
    return cpu_kernel("int4_linear_cpu")(
        x.contiguous(),
        packed.contiguous(),
        scale.contiguous(),
        zero.contiguous(),
        offsets.contiguous(),
        group_size,
        gated,
        kernel_isa_path(),
    )
