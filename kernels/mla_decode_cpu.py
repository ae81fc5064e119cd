"""Paged MLA decode on the CPU through the C++ kernel in csrc/mla_decode_cpu.cpp.

The torch reference pads every row's cache into one dense tensor and reads it several times; at batch
64 that copy was most of a decode step. The kernel reads each cached token once, from its block, with
an online softmax.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import cpu_extension


def paged_mla_decode_cpu(
    q_latent: Tensor, q_pe: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """Same contract as `mla_decode_reference.paged_mla_decode_ref`; needs the CPU kernels built."""
    fp32 = q_latent.dtype == torch.float32  # conversions only when needed, as in grouped_linear_cpu
    out = cpu_extension.require().paged_mla_decode_cpu(
        (q_latent if fp32 else q_latent.float()).contiguous(),
        (q_pe if q_pe.dtype == torch.float32 else q_pe.float()).contiguous(),
        cache.contiguous(),
        block_table.contiguous(),
        (seq_lens if seq_lens.dtype == torch.int64 else seq_lens.to(torch.int64)).contiguous(),
        float(scale),
    )
    return out if fp32 else out.to(q_latent.dtype)
