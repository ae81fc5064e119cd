"""Row counts of the CPU's bf16 GEMMs rounded up to a few sizes, so that oneDNN reuses its kernels.

oneDNN compiles a kernel for every new GEMM shape (and caches 1,024 of them). A prompt step's row counts
(tokens per step, rows per expert) change from step to step, so most of its bf16 GEMMs met a new shape:
300 x 512 x 256 rows took 3.1 ms a call with varying row counts against 0.31 ms with a repeated one,
the compile costing ~9 of the GEMMs it serves. Rounded up to one of 8 sizes per power of two (at most
1/8 more rows, zeros, whose outputs are dropped), the shapes repeat. fp32 GEMMs go to MKL, which
compiles nothing: they keep their row counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# oneDNN's dtypes among the plain weights.
_ONEDNN_DTYPES = (torch.bfloat16, torch.float16)


def onednn_gemm(weight: Tensor) -> bool:
    """Whether GEMMs against `weight` run through oneDNN (bf16 or fp16 on the CPU)."""
    return weight.device.type == "cpu" and weight.dtype in _ONEDNN_DTYPES


def padded_rows(rows: int) -> int:
    """rows rounded up to a multiple of 2^(bits(rows) - 4): 8 sizes per power of two from 16 rows up."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


def padded_copy(x: Tensor, dtype: torch.dtype, rows: int) -> Tensor:
    """x [R, K] in `dtype` with zero rows after it up to `rows` (x itself when it already is that)."""
    if x.shape[0] == rows and x.dtype == dtype and x.is_contiguous():
        return x
    out = x.new_empty(rows, x.shape[1], dtype=dtype)
    out[: x.shape[0]].copy_(x)
    out[x.shape[0] :].zero_()
    return out


def linear_padded(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear(x [R, K], weight) in weight's dtype, the GEMM run on padded_rows(R) rows."""
    rows = x.shape[0]
    return F.linear(padded_copy(x, weight.dtype, padded_rows(rows)), weight)[:rows]
