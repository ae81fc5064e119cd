"""Plain-torch references for the block-scaled FP8 (e4m3) quantization and GEMM.

They define the numerics the Triton kernels must reproduce and are the CPU path of the dispatcher.
All arithmetic is done in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK_SIZE = 128
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
# Floor on a block's amax so an all-zero block gets a finite, non-zero scale.
AMAX_FLOOR = 1e-4


def ue8m0_ceil(s: Tensor) -> Tensor:
    """Round positive fp32 scales up to a power of two, exactly.

    Adding a full mantissa to the bit pattern and keeping only the exponent is 2**ceil(log2(s)) without the
    rounding error a float log2 has just above a power of two.
    """
    bits = s.float().contiguous().view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def act_quant_ref(
    x: Tensor, block_size: int = BLOCK_SIZE, scale_fmt: str | None = None
) -> tuple[Tensor, Tensor]:
    """Quantize x [..., K] per row and per `block_size`-column block: (fp8 [..., K], fp32 [..., K/bs])."""
    assert x.shape[-1] % block_size == 0, f"last dim {x.shape[-1]} is not a multiple of {block_size}"
    blocks = x.float().unflatten(-1, (-1, block_size))
    s = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / FP8_MAX
    if scale_fmt == "ue8m0":
        s = ue8m0_ceil(s)
    y = (blocks / s.unsqueeze(-1)).to(FP8_DTYPE).flatten(-2)
    return y, s


def _expand_block_scale(s: Tensor, rows: int, cols: int, block_size: int) -> Tensor:
    """Broadcast a per-block scale grid to a [rows, cols] per-element scale."""
    return s.repeat_interleave(block_size, dim=0)[:rows].repeat_interleave(block_size, dim=1)[:, :cols]


def weight_dequant_ref(
    w: Tensor, s: Tensor, block_size: int = BLOCK_SIZE, out_dtype: torch.dtype | None = None
) -> Tensor:
    """W[i, j] = w[i, j] * s[i // bs, j // bs] for fp8 w [N, K] and fp32 s [ceil(N/bs), ceil(K/bs)]."""
    n, k = w.shape
    scale = _expand_block_scale(s.float(), n, k, block_size)
    return (w.float() * scale).to(out_dtype or torch.get_default_dtype())


def weight_quant_ref(w: Tensor, block_size: int = BLOCK_SIZE) -> tuple[Tensor, Tensor]:
    """Quantize w [N, K] per block_size x block_size block (edge blocks partial) to (fp8 q, fp32 s)."""
    n, k = w.shape
    nb, kb = -(-n // block_size), -(-k // block_size)
    # Zero padding to whole blocks leaves every block's amax unchanged.
    padded = w.float().new_zeros(nb * block_size, kb * block_size)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, block_size, kb, block_size)
    s = blocks.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR) / FP8_MAX
    q = (w.float() / _expand_block_scale(s, n, k, block_size)).to(FP8_DTYPE)
    return q, s


def fp8_gemm_ref(
    a: Tensor, a_s: Tensor, b: Tensor, b_s: Tensor, out_dtype: torch.dtype | None = None
) -> Tensor:
    """C = A @ B.T with per-K-block fp32 scaling: a fp8 [..., K], a_s [..., K/128], b fp8 [N, K], b_s
    [ceil(N/128), K/128]; each K-block's fp32 partial product is scaled by a_s * b_s before summing."""
    k = a.shape[-1]
    n = b.shape[0]
    assert k % BLOCK_SIZE == 0 and b.shape[1] == k, f"K mismatch or not a multiple of {BLOCK_SIZE}"
    a2 = a.reshape(-1, k).float()
    a_s2 = a_s.reshape(-1, k // BLOCK_SIZE).float()
    b2 = b.float()
    b_s_rows = b_s.float().repeat_interleave(BLOCK_SIZE, dim=0)[:n]
    out = a2.new_zeros(a2.shape[0], n)
    for kb in range(k // BLOCK_SIZE):
        cols = slice(kb * BLOCK_SIZE, (kb + 1) * BLOCK_SIZE)
        out += (a2[:, cols] @ b2[:, cols].T) * a_s2[:, kb, None] * b_s_rows[None, :, kb]
    return out.to(out_dtype or torch.get_default_dtype()).reshape(*a.shape[:-1], n)
