"""Triton kernel for INT4 group-wise weight-only linears; same signature and numerics as `int4_reference`.

Each K tile lies inside one quantization group (the tile width divides the group size), so the kernel
unpacks the tile's nibbles, subtracts the zero point (small integers, exact in bf16), runs the tensor-core
dot and scales the fp32 partial product once per tile: the weight is never materialized in memory.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from moelaunch.kernels.fp8_triton import _buffer_dtype, _gemm_block_m
from moelaunch.kernels.int8_triton import _fp32_dot

BLOCK_N = 64
MAX_BLOCK_K = 64


@triton.jit
def _int4_linear_kernel(
    x_ptr,
    p_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    GROUPS,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(
            x_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & k_ok[None, :], other=0.0
        )
        # A [BLOCK_K, BLOCK_N] tile of W.T: column k of row n is nibble k % 2 of byte k // 2.
        mask = col_ok[None, :] & k_ok[:, None]
        byte = tl.load(p_ptr + cols[None, :] * (K // 2) + k[:, None] // 2, mask=mask, other=0).to(tl.int32)
        q = (byte >> ((k[:, None] % 2) * 4)) & 0xF
        group = k0 // GROUP
        z = tl.load(z_ptr + cols * GROUPS + group, mask=col_ok, other=0).to(tl.int32)
        s = tl.load(s_ptr + cols * GROUPS + group, mask=col_ok, other=0.0)
        w = q - z[None, :]
        if FP32_DOT:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        acc += part * s[None, :]
    tl.store(
        y_ptr + rows[:, None] * N + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & col_ok[None, :],
    )


def int4_linear_triton(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_size: int) -> Tensor:
    k = x.shape[-1]
    n = packed.shape[0]
    assert packed.shape[1] * 2 == k, f"packed weight holds {packed.shape[1] * 2} columns, input has {k}"
    # The widest power-of-two tile up to 64 that divides the group: a tile never straddles two groups.
    block_k = math.gcd(group_size, MAX_BLOCK_K)
    assert block_k >= 16, f"group size {group_size} must be a multiple of 16"
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=_buffer_dtype(x.dtype), device=x.device)
    block_m = _gemm_block_m(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    _int4_linear_kernel[grid](
        x2,
        packed.contiguous(),
        scale.float().contiguous(),
        zero.contiguous(),
        y,
        m,
        n,
        k,
        scale.shape[1],
        GROUP=group_size,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        FP32_DOT=_fp32_dot(x),
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
