"""Plain-torch references for INT8 weights: per-output-channel symmetric weight quantization, the
weight-only linear (W8A16/W8A32) and the W8A8 linear (dynamic per-token activation scales, int8 GEMM with
int32 accumulation).

They define the numerics the Triton kernels must reproduce and are the CPU path of the dispatcher.
Quantization rounds half to even (torch.round); scales are fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT8_MAX = 127.0
# Floor on a row's amax so an all-zero row (a pruned channel, a padding token) gets a finite, non-zero scale.
INT8_AMAX_FLOOR = 1e-8


def _quantize_rows(x: Tensor, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row of x [..., K]: (int8 [..., K], fp32 scale [...]) with |error| <= scale / 2;
    amax [...]: each row's amax to use instead of its own (a slice quantized with its whole row's scale)."""
    x = x.float()
    s = (x.abs().amax(dim=-1) if amax is None else amax.float()).clamp_min(INT8_AMAX_FLOOR) / INT8_MAX
    q = torch.round(x / s.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, s


def int8_weight_quant_ref(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (int8 [N, K], fp32 scale [N]): one scale per output channel, amax / 127."""
    return _quantize_rows(w)


def int8_act_quant_ref(x: Tensor, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (int8 [..., K], fp32 scale [...]): one scale per token, amax / 127."""
    return _quantize_rows(x, amax)


def int8_dequant_ref(q: Tensor, s: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """W[n, k] = q[n, k] * s[n]."""
    return (q.float() * s.float().unsqueeze(-1)).to(out_dtype or torch.get_default_dtype())


def int8_linear_ref(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    """Weight-only: y = (x @ q.T) * s in fp32 (int8 values are exact in any float), output in x's dtype."""
    y = torch.matmul(x.float(), q.float().T) * s.float()
    return y.to(x.dtype)


def int8_gemm_ref(a: Tensor, a_s: Tensor, b: Tensor, b_s: Tensor, out_dtype: torch.dtype) -> Tensor:
    """C = (a @ b.T accumulated in int32) * a_s[:, None] * b_s[None, :] for int8 a [..., K], b [N, K]."""
    k = a.shape[-1]
    a2 = a.reshape(-1, k)
    # torch._int_mm: the int8 x int8 -> int32 GEMM, exact (|sum| <= K * 127^2 fits int32 for K < 133,000).
    acc = torch._int_mm(a2, b.T) if a2.shape[0] else a2.new_zeros(0, b.shape[0], dtype=torch.int32)
    out = acc.float() * a_s.reshape(-1, 1).float() * b_s.float()
    return out.to(out_dtype).reshape(*a.shape[:-1], b.shape[0])


def w8a8_linear_ref(x: Tensor, q: Tensor, s: Tensor, amax: Tensor | None = None) -> Tensor:
    """W8A8: quantize x per token (with amax [...] per token when given), int8 GEMM with int32
    accumulation, then both scales; x's dtype out."""
    x_q, x_s = int8_act_quant_ref(x, amax)
    return int8_gemm_ref(x_q, x_s, q, s, x.dtype)
