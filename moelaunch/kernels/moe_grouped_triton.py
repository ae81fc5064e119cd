"""The routed experts' grouped GEMM in Triton: one launch per projection for every local expert, over rows
sorted by expert with device offsets; same signatures and numerics as `moe_grouped_reference`.

How it avoids reading counts back (the idea of vLLM's fused_moe with moe_align_block_size, done inside
the GEMM): the grid is static, sized by an upper bound on row tiles (`max_tiles`). Each program loads the
offsets [E + 1] (a few hundred ints, cached), counts every expert's tiles of BLOCK_M rows, and finds by a
cumulative sum which expert and which of its tiles it owns; a program past the last tile returns at once.
No tile table is built and no launch is spent on alignment.

- gate/up ([E, 2I, K] stacks, gate rows first): each program computes the gate and the up tile of the
  same columns and writes silu(gate) * up, [rows, I] (wider, zero-filled, when the caller asks for padded
  columns: the FP8 down projection's input must be a whole number of 128-blocks).
- down ([E, N, I]): optionally each row scaled by its routing weight.
- Block-FP8 W8A8: activations quantized once per projection over all rows (1x128 blocks, `act_quant`),
  weights [E, N, K] e4m3 with [E, ceil(N/128), ceil(K/128)] scales; fp32 accumulation, each 128-wide
  K-block's product scaled by its row and weight-block scales, as in `fp8_triton`.

As in `fp8_triton`, outputs are written in fp32 under the interpreter and cast by torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moelaunch.kernels.fp8_reference import BLOCK_SIZE
from moelaunch.kernels.fp8_triton import _buffer_dtype
from moelaunch.kernels.int8_triton import _fp32_dot

_SCALE_BLOCK = tl.constexpr(BLOCK_SIZE)


def block_m_for(rows: int, experts: int) -> int:
    """Row tile: about the rows an expert gets on average (decode: 16, the tl.dot minimum), capped at 64.
    Decided from shapes only, so a compiled step has one kernel per bucket."""
    return min(64, max(16, triton.next_power_of_2(-(-rows // max(1, experts)))))


def max_tiles(rows: int, experts: int, block_m: int) -> int:
    """Most row tiles `rows` rows over `experts` experts can need: each busy expert adds at most one
    partial tile, and at most `rows` experts are busy."""
    return triton.cdiv(rows, block_m) + min(experts, rows)


@triton.jit
def _find_tile(offsets_ptr, tile, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """(expert, first row, end row) of the tile-th tile over the experts' runs of rows; expert == E past
    the last tile."""
    ids = tl.arange(0, E_POW2)
    lo = tl.load(offsets_ptr + ids, mask=ids < E, other=0)
    hi = tl.load(offsets_ptr + ids + 1, mask=ids < E, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, axis=0)
    expert = tl.sum((ends <= tile).to(tl.int32), axis=0)
    mine = ids == expert
    first_tile = tl.sum(tl.where(mine, ends - tiles, 0), axis=0)
    start = tl.sum(tl.where(mine, lo, 0), axis=0) + (tile - first_tile) * BLOCK_M
    end = tl.sum(tl.where(mine, hi, 0), axis=0)
    return expert, start, end


@triton.jit
def _weight_tile(w_ptr, ws_ptr, w_rows, s_rows, row_ok, k0, ks, K_W, k_blocks, FP8: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] tile of W.T at K offset k0 (rows w_rows of one expert's [N, K] weight at w_ptr)
    and, for FP8, each column's weight-block scale (rows s_rows of the expert's scales at ws_ptr; one
    K-block, as BLOCK_K is 128)."""
    k_ok = (k0 + ks) < K_W
    ptrs = w_ptr + w_rows[None, :] * K_W + k0 + ks[:, None]
    w = tl.load(ptrs, mask=row_ok[None, :] & k_ok[:, None], other=0.0)
    scale = 1.0
    if FP8:
        scale = tl.load(ws_ptr + s_rows * k_blocks + k0 // _SCALE_BLOCK, mask=row_ok, other=0.0)
    return w, scale


@triton.jit
def _dot(a, w, FP32_DOT: tl.constexpr):
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(a, w.to(a.dtype))


@triton.jit
def _moe_gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    offsets_ptr,
    row_w_ptr,
    E,
    N,
    OUT_N,
    K_X,
    K_W,
    UP_ROW,
    UP_SCALE_ROW,
    stride_we,
    stride_se,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_POW2: tl.constexpr,
    FP8: tl.constexpr,
    SILU: tl.constexpr,
    ROW_WEIGHTS: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    expert, start, end = _find_tile(offsets_ptr, tl.program_id(0), E, BLOCK_M, E_POW2)
    if expert >= E:
        return
    w_ptr += expert.to(tl.int64) * stride_we  # int64: a whole layer's stack passes 2^31 elements
    ws_ptr += expert * stride_se
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_blocks = K_X // BLOCK_K  # FP8: x is quantized over whole 128-blocks, K_X a multiple of 128
    w_blocks = tl.cdiv(K_W, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_X, BLOCK_K):
        a = tl.load(
            x_ptr + rows[:, None] * K_X + k0 + ks[None, :],
            mask=row_ok[:, None] & ((k0 + ks) < K_X)[None, :],
            other=0.0,
        )
        w, w_s = _weight_tile(w_ptr, ws_ptr, cols, cols // _SCALE_BLOCK, col_ok, k0, ks, K_W, w_blocks, FP8)
        if FP8:
            a_s = tl.load(xs_ptr + rows * x_blocks + k0 // BLOCK_K, mask=row_ok, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        else:
            acc += _dot(a, w, FP32_DOT)
        if SILU:
            # The up projection: the same columns of the rows after the gate's (its scales likewise).
            u_rows, u_s_rows = UP_ROW + cols, UP_SCALE_ROW + cols // _SCALE_BLOCK
            u, u_s = _weight_tile(w_ptr, ws_ptr, u_rows, u_s_rows, col_ok, k0, ks, K_W, w_blocks, FP8)
            if FP8:
                acc_up += tl.dot(a, u) * a_s[:, None] * u_s[None, :]
            else:
                acc_up += _dot(a, u, FP32_DOT)
    if SILU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if ROW_WEIGHTS:
        acc = acc * tl.load(row_w_ptr + rows, mask=row_ok, other=0.0)[:, None]
    # Columns N..OUT_N (padding asked for by the caller) hold zeros: their weight rows were masked.
    tl.store(
        out_ptr + rows[:, None] * OUT_N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (cols < OUT_N)[None, :],
    )


def moe_grouped_gemm_triton(
    x: Tensor,
    x_scale: Tensor | None,
    offsets: Tensor,
    weight: Tensor,
    weight_scale: Tensor | None,
    silu: bool,
    row_weights: Tensor | None,
    out_cols: int,
    out_dtype: torch.dtype,
) -> Tensor:
    """See `moe_grouped_reference.moe_grouped_gemm_ref`."""
    rows, k_x = x.shape
    experts, w_rows, k_w = weight.shape
    n = w_rows // 2 if silu else w_rows
    fp8 = weight_scale is not None
    if fp8:
        assert x_scale is not None and k_x % BLOCK_SIZE == 0, "FP8 rows come quantized in whole 128-blocks"
    out = torch.empty(rows, out_cols, dtype=_buffer_dtype(out_dtype), device=x.device)
    if rows == 0:
        return out.to(out_dtype)
    block_m = block_m_for(rows, experts)
    block_n = 128 if fp8 else 64
    scale = weight_scale.float().contiguous() if fp8 else weight  # unread when not fp8
    grid = (max_tiles(rows, experts, block_m), triton.cdiv(out_cols, block_n))
    _moe_gemm_kernel[grid](
        x.contiguous(),
        x_scale.float().contiguous() if fp8 else x,
        weight.contiguous(),
        scale,
        out,
        offsets.contiguous(),
        row_weights.float().contiguous() if row_weights is not None else x,
        experts,
        n,
        out_cols,
        k_x,
        k_w,
        n,
        triton.cdiv(n, BLOCK_SIZE),
        w_rows * k_w,
        scale[0].numel() if fp8 else 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_SIZE if fp8 else 64,
        E_POW2=triton.next_power_of_2(experts),
        FP8=fp8,
        SILU=silu,
        ROW_WEIGHTS=row_weights is not None,
        FP32_DOT=not fp8 and _fp32_dot(x),
        num_warps=8 if block_m >= 64 else 4,
        num_stages=3,  # software pipelining of the K loop on the GPU (vLLM's default for these tiles)
    )
    return out.to(out_dtype)
