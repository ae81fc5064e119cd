"""The INT8 / INT4 weight entry points: Triton, the C++ CPU kernels or the torch reference, as `selection`
says; quantizing and dequantizing weights (conversion, load) always take the references.

The grouped forms run rows grouped by `offsets` against stacked weights [G, N, ...] (the routed experts;
a plain projection is one group); `gated` ([gate; up] stacks) returns silu(gate) * up, which the C++
kernels apply as they write and the other paths in a pass of their own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from moelaunch.kernels import int4_reference as int4_ref
from moelaunch.kernels import int8_reference as int8_ref
from moelaunch.kernels import int_linear_cpu as int_cpu
from moelaunch.kernels.dispatch import one_group
from moelaunch.kernels.fused import silu_mul
from moelaunch.kernels.grouped_linear_reference import per_group
from moelaunch.kernels.int4_reference import INT4_GROUP_SIZE
from moelaunch.kernels.selection import int_linear_on_cpu, use_triton


def _int8_triton() -> Any:
    # Imported on first use, like dispatch._triton: CPU-only runs never load Triton. While traced, the
    # launchers' registered ops (`triton_ops`).
    from moelaunch.kernels import int8_triton, triton_ops

    return triton_ops.entry(int8_triton)


def _int4_triton() -> Any:
    from moelaunch.kernels import int4_triton, triton_ops

    return triton_ops.entry(int4_triton)


def int8_weight_quant(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (int8 [N, K], fp32 per-output-channel scale [N])."""
    return int8_ref.int8_weight_quant_ref(w)


def int8_dequant(q: Tensor, s: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    return int8_ref.int8_dequant_ref(q, s, out_dtype)


def _as_one_group(kernel: Callable[..., Tensor], x: Tensor, *stacks: Tensor) -> Tensor:
    """A grouped CPU kernel on x [..., K] and one weight's tensors: [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    out = kernel(rows, *(s.unsqueeze(0) for s in stacks), one_group(rows.shape[0]))
    return out.view(*x.shape[:-1], out.shape[-1])


def int8_linear(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    """Weight-only INT8: x @ (q * s[:, None]).T, in x's dtype."""
    if use_triton(x):
        return _int8_triton().int8_linear_triton(x, q, s)
    if int_linear_on_cpu(x):
        return _as_one_group(int_cpu.int8_linear_cpu, x, q, s)
    return int8_ref.int8_linear_ref(x, q, s)


def _gate(out: Tensor, gated: bool) -> Tensor:
    return silu_mul(*out.chunk(2, dim=-1)) if gated else out


def int8_grouped_linear(x: Tensor, q: Tensor, s: Tensor, offsets: Tensor, gated: bool = False) -> Tensor:
    """int8_linear per group: x [T, K], q [G, N, K], s [G, N] -> [T, N] (gated: [T, N / 2])."""
    if int_linear_on_cpu(x):
        return int_cpu.int8_linear_cpu(x, q, s, offsets, gated)
    return _gate(per_group(int8_linear, x, offsets, q, s), gated)


def int8_act_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (int8 [..., K], fp32 per-token scale [...])."""
    fn = _int8_triton().int8_act_quant_triton if use_triton(x) else int8_ref.int8_act_quant_ref
    return fn(x)


def w8a8_linear(x: Tensor, q: Tensor, s: Tensor, amax: Tensor | None = None) -> Tensor:
    """W8A8: x quantized per token, int8 GEMM with int32 accumulation, then token and channel scales;
    amax [...] (x's leading shape, fp32): each token's amax to quantize with instead of its own."""
    if use_triton(x):
        return _int8_triton().w8a8_linear_triton(x, q, s, amax)
    if int_linear_on_cpu(x):
        rows = None if amax is None else amax.reshape(-1).float().contiguous()
        return _as_one_group(functools.partial(int_cpu.w8a8_linear_cpu, row_amax=rows), x, q, s)
    return int8_ref.w8a8_linear_ref(x, q, s, amax)


def w8a8_grouped_linear(x: Tensor, q: Tensor, s: Tensor, offsets: Tensor, gated: bool = False) -> Tensor:
    """w8a8_linear per group: x [T, K], q [G, N, K], s [G, N] -> [T, N] (gated: [T, N / 2])."""
    if int_linear_on_cpu(x):
        return int_cpu.w8a8_linear_cpu(x, q, s, offsets, gated)
    return _gate(per_group(w8a8_linear, x, offsets, q, s), gated)


def int4_weight_quant(w: Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[Tensor, Tensor, Tensor]:
    """w [N, K] -> (packed uint8 [N, K/2], fp32 scale [N, groups], uint8 zero point [N, groups])."""
    return int4_ref.int4_weight_quant_ref(w, group_size)


def int4_dequant(
    packed: Tensor, scale: Tensor, zero: Tensor, group_size: int, out_dtype: torch.dtype | None = None
) -> Tensor:
    return int4_ref.int4_dequant_ref(packed, scale, zero, group_size, out_dtype)


def int4_linear(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_size: int) -> Tensor:
    """Weight-only INT4, group-wise: x @ dequant(W).T, the weight unpacked inside the kernel on CUDA."""
    if use_triton(x):
        return _int4_triton().int4_linear_triton(x, packed, scale, zero, group_size)
    if int_linear_on_cpu(x):
        kernel = functools.partial(int_cpu.int4_linear_cpu, group_size=group_size)
        return _as_one_group(kernel, x, packed, scale, zero)
    return int4_ref.int4_linear_ref(x, packed, scale, zero, group_size)


def int4_grouped_linear(
    x: Tensor,
    packed: Tensor,
    scale: Tensor,
    zero: Tensor,
    offsets: Tensor,
    group_size: int,
    gated: bool = False,
) -> Tensor:
    """int4_linear per group: x [T, K], packed [G, N, K/2], scale / zero [G, N, groups] -> [T, N] (gated:
    [T, N / 2])."""
    if int_linear_on_cpu(x):
        return int_cpu.int4_linear_cpu(x, packed, scale, zero, offsets, group_size, gated)
    linear = functools.partial(int4_linear, group_size=group_size)
    return _gate(per_group(linear, x, offsets, packed, scale, zero), gated)
