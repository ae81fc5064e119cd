"""Paged MLA decode on the CPU through the C++ kernel in csrc/mla_decode_cpu.cpp.

The torch reference pads every row's cache into one dense tensor and reads it several times; at batch
64 that copy is most of a decode step. The kernel reads each cached token once, from its block, with
an online softmax; an fp8 cache's block is dequantized in the kernel (1 byte per value read). bf16
queries over a bf16 cache multiply in bf16 pairs (vdpbf16ps, fp32 sums, softmax weights rounded to bf16)
on a CPU with AVX512-BF16, through the AMX tiles on one with AMX-BF16 (widths multiples of 32), unless
MOELAUNCH_CPU_ISA forces a lower path; there queries over an fp8 cache read its values dequantized to
bf16 (a 16-token piece at a time on the tiles, a block at a time with vdpbf16ps).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelaunch.kernels.cpu_extension import cast_if_needed
from moelaunch.kernels.cpu_ops import cpu_kernel
from moelaunch.kernels.selection import bf16_dot_products, kernel_isa_path


def paged_mla_decode_cpu(
    q_latent: Tensor,
    q_pe: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    starts: Tensor | None = None,
    cache_scales: Tensor | None = None,
    fp8_as: torch.dtype = torch.float32,
) -> Tensor:
    """Same contract as `mla_decode_reference.paged_mla_decode_ref` for fp32, bf16 and fp8 caches (an fp8
    cache comes with its scales and is dequantized in the kernel); needs the CPU kernels built. fp8_as:
    the float cache an fp8 one stands in for; as bf16 it is read as a bf16 cache of its values."""
    rows = (block_table.contiguous(), cast_if_needed(seq_lens, torch.int64).contiguous(), float(scale))
    first = cast_if_needed(starts, torch.int64).contiguous() if starts is not None else None
    # bf16 queries go in as they are: the kernel widens them, or multiplies them with a bf16 cache or an
    # fp8 one's values dequantized to bf16. On a CPU with bf16 dot products, fp32 queries meeting a bf16
    # cache, or an fp8 one standing in for it, are rounded to bf16.
    bf16_cache = cache.dtype == torch.bfloat16 or (cache_scales is not None and fp8_as == torch.bfloat16)
    in_bf16 = q_latent.dtype == torch.bfloat16 or (bf16_cache and bf16_dot_products())
    dtype = torch.bfloat16 if in_bf16 else torch.float32
    queries = (cast_if_needed(q_latent, dtype).contiguous(), cast_if_needed(q_pe, dtype).contiguous())
    if cache_scales is None:
        out = cpu_kernel("paged_mla_decode_cpu")(
            *queries, cache.contiguous(), *rows, first, kernel_isa_path()
        )
    else:
        out = cpu_kernel("paged_mla_decode_fp8_cpu")(
            *queries, cache.contiguous(), cache_scales.contiguous(), *rows, first, kernel_isa_path()
        )
    return cast_if_needed(out, q_latent.dtype)
