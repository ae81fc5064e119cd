"""Triton kernels for the block-scaled FP8 path; same signatures and numerics as `fp8_reference`.

Under the Triton interpreter (TRITON_INTERPRET=1) float->float8 casts halve values just below a power of
two (31.6 -> 16) and float->bf16 casts truncate (triton issue 8322), so there the kernels write fp32 and
torch does the final cast; on a GPU the kernels cast in-register. Each kernel casts to its output
pointer's element type, so the choice is made only by the dtype of the buffer the wrapper allocates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from moelaunch.kernels.fp8_reference import AMAX_FLOOR, BLOCK_SIZE, FP8_DTYPE, FP8_MAX
from moelaunch.kernels.triton_interpreter import interpreting, sm_count

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
    SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_blocks = K // BLOCK_K
    # This program's share of the K blocks; with SPLIT_K > 1 it writes an fp32 partial sum, slice pid_k.
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    kb_first = pid_k * per_split
    kb_end = tl.minimum(kb_first + per_split, k_blocks)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = kb_first * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    # A [M, K] and B [N, K] are both K-major, as the fp8 tensor-core instructions want both operands.
    a_ptrs = a_ptr + rows[:, None] * K + ks[None, :]
    b_ptrs = b_ptr + cols[:, None] * K + ks[None, :]
    a_s_ptrs = a_s_ptr + rows * k_blocks + kb_first
    b_s_ptrs = b_s_ptr + (cols // BLOCK_K) * k_blocks + kb_first
    # SWAP_AB computes C.T = B @ A.T: a decode batch's few rows become the narrow side of the tile, so the
    # wide side (64+ weight rows) fills the tensor-core instruction's M, which is at least 64 on Hopper.
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(kb_first, kb_end):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
        a_s = tl.load(a_s_ptrs, mask=row_ok, other=0.0)
        b_s = tl.load(b_s_ptrs, mask=col_ok, other=0.0)
        if SWAP_AB:
            acc += tl.dot(b, tl.trans(a)) * b_s[:, None] * a_s[None, :]
        else:
            acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        a_s_ptrs += 1
        b_s_ptrs += 1
    c_ptr += pid_k * M * N
    if SWAP_AB:
        c_ptrs = c_ptr + rows[None, :] * N + cols[:, None]
        c_mask = row_ok[None, :] & col_ok[:, None]
    else:
        c_ptrs = c_ptr + rows[:, None] * N + cols[None, :]
        c_mask = row_ok[:, None] & col_ok[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@dataclass(frozen=True)
class GemmConfig:
    """One tile shape of `_fp8_gemm_kernel` (BLOCK_K is the scale block, 128)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False

    def meta(self) -> dict[str, Any]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "SWAP_AB": self.swap_ab}

    def triton(self) -> triton.Config:
        return triton.Config(self.meta(), num_warps=self.num_warps, num_stages=self.num_stages)


# Autotuned per (N, K, split) on a GPU, first listed used under the interpreter. Prefill: square-ish tiles
# that reuse each weight tile over many rows. Decode (M <= SMALL_M): 16 rows (every row a decode batch
# has, or a quarter of them), wide weight tiles, so a program streams weight bytes and little else.
LARGE_M_CONFIGS = (
    GemmConfig(128, 128, 8, 3),
    GemmConfig(128, 256, 8, 3),
    GemmConfig(64, 128, 4, 4),
)
SMALL_M_CONFIGS = (
    GemmConfig(16, 128, 4, 4, swap_ab=True),
    GemmConfig(16, 64, 4, 5, swap_ab=True),
    GemmConfig(16, 256, 8, 3, swap_ab=True),
)
SMALL_M = 64
# Split K over programs only where the (row, column) tiles leave SMs idle, each split at least this many
# K blocks (so its loads still pipeline), and at most MAX_SPLIT_K partial sums to add.
MIN_K_BLOCKS_PER_SPLIT = 4
MAX_SPLIT_K = 8

# The same kernel, autotuned over each list on a GPU.
_TUNED = {
    small: triton.autotune([c.triton() for c in configs], key=["N", "K", "SPLIT_K"])(_fp8_gemm_kernel)
    for small, configs in ((False, LARGE_M_CONFIGS), (True, SMALL_M_CONFIGS))
}


def _gemm_block_m(m: int) -> int:
    """Smallest power-of-two row tile (>= 16, the tl.dot minimum) covering m, capped at 64."""
    return min(64, max(16, triton.next_power_of_2(m)))


def split_k_for(m: int, n: int, k: int, sms: int) -> int:
    """K splits for a small-M GEMM from its shapes and the SM count: enough programs (at 128 columns
    each) for one wave, none shorter than MIN_K_BLOCKS_PER_SPLIT."""
    tiles = max(1, triton.cdiv(m, 16) * triton.cdiv(n, 128))
    return max(1, min(sms // tiles, (k // BLOCK_SIZE) // MIN_K_BLOCKS_PER_SPLIT, MAX_SPLIT_K))


def fp8_gemm_triton(
    a: Tensor, a_s: Tensor, b: Tensor, b_s: Tensor, out_dtype: torch.dtype | None = None
) -> Tensor:
    """The small-M path (split K, swapped operands) for M <= SMALL_M, else the prefill tiles. On a GPU
    each is autotuned: the first call per (N, K, split) times every config of its list (the engine's
    warm-up steps make those calls before any CUDA graph is captured); the interpreter runs each list's
    first config."""
    k = a.shape[-1]
    m, n = a.numel() // max(1, k), b.shape[0]
    small = m <= SMALL_M
    split_k = split_k_for(m, n, k, sm_count(a.device)) if small else 1
    config = (SMALL_M_CONFIGS if small else LARGE_M_CONFIGS)[0] if interpreting() else None
    return fp8_gemm_with(a, a_s, b, b_s, out_dtype, config=config, split_k=split_k)


def fp8_gemm_with(
    a: Tensor,
    a_s: Tensor,
    b: Tensor,
    b_s: Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    config: GemmConfig | None,
    split_k: int = 1,
) -> Tensor:
    """C = A @ B.T as `fp8_reference.fp8_gemm_ref`, with the given tiles and K split; config None
    autotunes over the list for A's row count."""
    k = a.shape[-1]
    n = b.shape[0]
    assert k % BLOCK_SIZE == 0 and b.shape[1] == k, f"K mismatch or not a multiple of {BLOCK_SIZE}"
    a2 = a.reshape(-1, k).contiguous()
    m = a2.shape[0]
    out_dtype = out_dtype or torch.get_default_dtype()
    if split_k > 1:
        c = torch.empty(split_k, m, n, dtype=torch.float32, device=a.device)
    else:
        c = torch.empty(m, n, dtype=_buffer_dtype(out_dtype), device=a.device)
    args = (
        a2,
        b.contiguous(),
        c,
        a_s.reshape(m, k // BLOCK_SIZE).float().contiguous(),
        b_s.float().contiguous(),
    )
    if m > 0 and config is None:

        def grid(meta: dict[str, Any]) -> tuple[int, int, int]:
            return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), split_k

        _TUNED[m <= SMALL_M][grid](*args, m, n, k, BLOCK_K=BLOCK_SIZE, SPLIT_K=split_k)
    elif m > 0:
        _fp8_gemm_kernel[(triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), split_k)](
            *args,
            m,
            n,
            k,
            BLOCK_K=BLOCK_SIZE,
            SPLIT_K=split_k,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **config.meta(),
        )
    if split_k > 1:
        c = c.sum(dim=0)  # the partial sums of the K splits, in fp32
    return c.to(out_dtype).reshape(*a.shape[:-1], n)
