"""Triton kernels for INT8 weights; same signatures and numerics as `int8_reference`.

- int8_linear_triton: weight-only; int8 weight tiles are widened to the activation dtype in registers
  (exact), fp32 accumulation, the per-channel scale applied once per output tile.
- int8_act_quant_triton: per-token scales (amax / 127) and round-half-even quantization.
- int8_gemm_triton: int8 x int8 tensor-core GEMM with int32 accumulation, then the token and channel scales.
As in `fp8_triton`, outputs are written in fp32 under the interpreter and cast by torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moelaunch.kernels.fp8_triton import _buffer_dtype, _gemm_block_m
from moelaunch.kernels.int8_reference import INT8_AMAX_FLOOR, INT8_MAX
from moelaunch.kernels.triton_interpreter import interpreting

_INT8_MAX = tl.constexpr(INT8_MAX)
_AMAX_FLOOR = tl.constexpr(INT8_AMAX_FLOOR)
# 1.5 * 2^23: adding and subtracting it rounds an fp32 of magnitude < 2^22 to the nearest integer, ties to
# even, exactly like torch.round (IEEE addition; libdevice.rint has no interpreter twin).
_ROUND_MAGIC = tl.constexpr(12582912.0)
BLOCK_N = 64
BLOCK_K = 64  # >= 32: the int8 tensor-core instruction's K
ACT_ROWS = 16
ACT_BLOCK = 128


def _fp32_dot(x: Tensor) -> bool:
    """Whether the weight-only dot runs in fp32 (ieee, not tf32): for fp32 activations, and for bf16 ones
    under the interpreter, whose bf16 tl.dot is wrong (on a GPU bf16 products are exact in the fp32
    accumulator, so the result is the same)."""
    return x.dtype == torch.float32 or interpreting()


@triton.jit
def _round_half_even(x):
    return (x + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def _int8_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(
            x_ptr + rows[:, None] * K + k0 + ks[None, :], mask=(rows[:, None] < M) & k_ok[None, :], other=0.0
        )
        # W is [N, K] row-major; read a [BLOCK_K, BLOCK_N] tile of W.T and widen it to x's dtype.
        w_ptrs = w_ptr + cols[None, :] * K + k0 + ks[:, None]
        w = tl.load(w_ptrs, mask=(cols[None, :] < N) & k_ok[:, None], other=0)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    s = tl.load(s_ptr + cols, mask=cols < N, other=0.0)
    y = acc * s[None, :]
    tl.store(
        y_ptr + rows[:, None] * N + cols[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def int8_linear_triton(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    k = x.shape[-1]
    n = q.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=_buffer_dtype(x.dtype), device=x.device)
    block_m = _gemm_block_m(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    _int8_linear_kernel[grid](
        x2,
        q.contiguous(),
        s.float().contiguous(),
        y,
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        FP32_DOT=_fp32_dot(x),
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


@triton.jit
def _int8_act_quant_kernel(
    x_ptr, amax_ptr, q_ptr, s_ptr, M, K, ROWS: tl.constexpr, BLOCK: tl.constexpr, AMAX_GIVEN: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < M
    if AMAX_GIVEN:  # the whole row's amax, for a tensor-parallel slice of it
        amax = tl.load(amax_ptr + rows, mask=row_ok, other=0.0)
    else:  # two passes over the row: its amax first, then the quantized values
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            mask = row_ok[:, None] & ((k0 + cols) < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * K + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    # div_rn: IEEE division, as torch's (a GPU's default fp32 `/` is approximate).
    s = tl.div_rn(tl.maximum(amax, _AMAX_FLOOR), _INT8_MAX)
    for k0 in range(0, K, BLOCK):
        mask = row_ok[:, None] & ((k0 + cols) < K)[None, :]
        offs = rows[:, None] * K + k0 + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(x, s[:, None])), -_INT8_MAX), _INT8_MAX)
        tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(s_ptr + rows, s, mask=row_ok)


def int8_act_quant_triton(x: Tensor, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    given = amax is not None
    rows_amax = amax.reshape(m).float().contiguous() if given else s  # s: a placeholder, never read
    _int8_act_quant_kernel[(triton.cdiv(m, ACT_ROWS),)](
        x2, rows_amax, q, s, m, k, ROWS=ACT_ROWS, BLOCK=ACT_BLOCK, AMAX_GIVEN=given
    )
    return q.reshape(x.shape), s.reshape(x.shape[:-1])


@triton.jit
def _int8_gemm_kernel(
    a_ptr,
    b_ptr,
    a_s_ptr,
    b_s_ptr,
    c_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(
            a_ptr + rows[:, None] * K + k0 + ks[None, :], mask=(rows[:, None] < M) & k_ok[None, :], other=0
        )
        b = tl.load(
            b_ptr + cols[None, :] * K + k0 + ks[:, None], mask=(cols[None, :] < N) & k_ok[:, None], other=0
        )
        acc += tl.dot(a, b)  # int8 x int8 -> int32, exact
    a_s = tl.load(a_s_ptr + rows, mask=rows < M, other=0.0)
    b_s = tl.load(b_s_ptr + cols, mask=cols < N, other=0.0)
    # Same order as the reference: (acc * a_s) * b_s.
    c = acc.to(tl.float32) * a_s[:, None] * b_s[None, :]
    tl.store(
        c_ptr + rows[:, None] * N + cols[None, :],
        c.to(c_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def int8_gemm_triton(a: Tensor, a_s: Tensor, b: Tensor, b_s: Tensor, out_dtype: torch.dtype) -> Tensor:
    k = a.shape[-1]
    n = b.shape[0]
    a2 = a.reshape(-1, k).contiguous()
    m = a2.shape[0]
    c = torch.empty(m, n, dtype=_buffer_dtype(out_dtype), device=a.device)
    block_m = _gemm_block_m(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    _int8_gemm_kernel[grid](
        a2,
        b.contiguous(),
        a_s.reshape(m).float().contiguous(),
        b_s.float().contiguous(),
        c,
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return c.to(out_dtype).reshape(*a.shape[:-1], n)


def w8a8_linear_triton(x: Tensor, q: Tensor, s: Tensor, amax: Tensor | None = None) -> Tensor:
    x_q, x_s = int8_act_quant_triton(x, amax)
    return int8_gemm_triton(x_q, x_s, q, s, x.dtype)
