"""Triton kernels for the block-scaled FP8 path; same signatures and numerics as `fp8_reference`.

Under the Triton interpreter (TRITON_INTERPRET=1) float->float8 casts halve values just below a power of
two (31.6 -> 16) and float->bf16 casts truncate (triton issue 8322), so there the kernels write fp32 and
torch does the final cast; on a GPU the kernels cast in-register. Each kernel casts to its output
pointer's element type, so the choice is made only by the dtype of the buffer the wrapper allocates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moelaunch.kernels.fp8_reference import AMAX_FLOOR, BLOCK_SIZE, FP8_DTYPE, FP8_MAX
from moelaunch.kernels.triton_interpreter import interpreting

# Triton kernels may read only constexpr globals.
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_FP8_MAX = tl.constexpr(FP8_MAX)
# Rows per act_quant program: several rows per program keeps the interpreter's per-program cost low.
ACT_ROWS = 16


def _buffer_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype a kernel should store: the final one on a GPU, fp32 (cast later in torch) when interpreting."""
    return torch.float32 if interpreting() else dtype


@triton.jit
def _act_quant_kernel(
    x_ptr, y_ptr, s_ptr, M, K, BLOCK: tl.constexpr, ROWS: tl.constexpr, UE8M0: tl.constexpr
):
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    mask = rows[:, None] < M
    offs = rows[:, None] * K + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # div_rn: a GPU's default fp32 `/` is approximate; IEEE division keeps scales and values equal to torch's.
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR), _FP8_MAX)
    if UE8M0:
        # Exact 2**ceil(log2(s)) for positive normal floats: carry any mantissa bit into the exponent.
        s = ((s.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    y = tl.div_rn(x, s[:, None])
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * (K // BLOCK) + kb, s, mask=rows < M)


def act_quant_triton(
    x: Tensor, block_size: int = BLOCK_SIZE, scale_fmt: str | None = None
) -> tuple[Tensor, Tensor]:
    k = x.shape[-1]
    assert k % block_size == 0, f"last dim {k} is not a multiple of {block_size}"
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, k, dtype=_buffer_dtype(FP8_DTYPE), device=x.device)
    s = torch.empty(m, k // block_size, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, ACT_ROWS), k // block_size)
    _act_quant_kernel[grid](x2, y, s, m, k, BLOCK=block_size, ROWS=ACT_ROWS, UE8M0=scale_fmt == "ue8m0")
    return y.to(FP8_DTYPE).reshape(x.shape), s.reshape(*x.shape[:-1], k // block_size)


@triton.jit
def _weight_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK + tl.arange(0, BLOCK)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    offs = rows[:, None] * K + cols[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + pid_n * tl.cdiv(K, BLOCK) + pid_k)
    tl.store(out_ptr + offs, (w * s).to(out_ptr.dtype.element_ty), mask=mask)


def weight_dequant_triton(
    w: Tensor, s: Tensor, block_size: int = BLOCK_SIZE, out_dtype: torch.dtype | None = None
) -> Tensor:
    n, k = w.shape
    out_dtype = out_dtype or torch.get_default_dtype()
    out = torch.empty(n, k, dtype=_buffer_dtype(out_dtype), device=w.device)
    grid = (triton.cdiv(n, block_size), triton.cdiv(k, block_size))
    _weight_dequant_kernel[grid](w.contiguous(), s.float().contiguous(), out, n, k, BLOCK=block_size)
    return out.to(out_dtype)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_s_ptr,
    b_s_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_blocks = K // BLOCK_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    a_ptrs = a_ptr + rows[:, None] * K + ks[None, :]
    # B is [N, K] row-major; read it as a [BLOCK_K, BLOCK_N] tile of B.T.
    b_ptrs = b_ptr + cols[None, :] * K + ks[:, None]
    a_s_ptrs = a_s_ptr + rows * k_blocks
    b_s_ptrs = b_s_ptr + (cols // BLOCK_K) * k_blocks
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(k_blocks):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        a_s = tl.load(a_s_ptrs, mask=row_ok, other=0.0)
        b_s = tl.load(b_s_ptrs, mask=col_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        a_s_ptrs += 1
        b_s_ptrs += 1
    c_ptrs = c_ptr + rows[:, None] * N + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _gemm_block_m(m: int) -> int:
    """Smallest power-of-two row tile (>= 16, the tl.dot minimum) covering m, capped at 64."""
    return min(64, max(16, triton.next_power_of_2(m)))


def fp8_gemm_triton(
    a: Tensor, a_s: Tensor, b: Tensor, b_s: Tensor, out_dtype: torch.dtype | None = None
) -> Tensor:
    k = a.shape[-1]
    n = b.shape[0]
    assert k % BLOCK_SIZE == 0 and b.shape[1] == k, f"K mismatch or not a multiple of {BLOCK_SIZE}"
    a2 = a.reshape(-1, k).contiguous()
    m = a2.shape[0]
    out_dtype = out_dtype or torch.get_default_dtype()
    c = torch.empty(m, n, dtype=_buffer_dtype(out_dtype), device=a.device)
    block_m, block_n = _gemm_block_m(m), BLOCK_SIZE
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](
        a2,
        b.contiguous(),
        c,
        a_s.reshape(m, k // BLOCK_SIZE).float().contiguous(),
        b_s.float().contiguous(),
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_SIZE,
    )
    return c.to(out_dtype).reshape(*a.shape[:-1], n)
