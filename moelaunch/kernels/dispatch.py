"""The FP8, paged MLA decode and plain linear entry points: each call runs the implementation that
`selection` picks for its tensors (Triton, the C++ CPU kernels or the torch reference).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from moelaunch.kernels import fp8_reference as ref
from moelaunch.kernels import grouped_linear_cpu as linear_cpu
from moelaunch.kernels import grouped_linear_reference as linear_ref
from moelaunch.kernels import mla_decode_cpu as mla_cpu
from moelaunch.kernels import mla_decode_reference as mla_ref
from moelaunch.kernels.fp8_reference import BLOCK_SIZE
from moelaunch.kernels.fused import silu_mul
from moelaunch.kernels.gemm_rows import linear_padded, onednn_gemm
from moelaunch.kernels.selection import (
    grouped_linear_on_cpu,
    paged_mla_decode_on_cpu,
    use_triton,
    uses_grouped_linear_kernel,
)


def _triton() -> Any:
    # Imported on first use: a CPU-only run never pays for (or depends on) Triton, and the kernels get
    # decorated after the caller has had the chance to set TRITON_INTERPRET.
    from moelaunch.kernels import fp8_triton, triton_ops

    return triton_ops.entry(fp8_triton)


def act_quant(x: Tensor, block_size: int = BLOCK_SIZE, scale_fmt: str | None = None) -> tuple[Tensor, Tensor]:
    fn = _triton().act_quant_triton if use_triton(x) else ref.act_quant_ref
    return fn(x, block_size, scale_fmt)


def weight_dequant(
    w: Tensor, s: Tensor, block_size: int = BLOCK_SIZE, out_dtype: torch.dtype | None = None
) -> Tensor:
    fn = _triton().weight_dequant_triton if use_triton(w) else ref.weight_dequant_ref
    return fn(w, s, block_size, out_dtype)


def weight_quant(w: Tensor, block_size: int = BLOCK_SIZE) -> tuple[Tensor, Tensor]:
    # Only used to make checkpoints, never on the hot path: the reference is enough everywhere.
    return ref.weight_quant_ref(w, block_size)


def fp8_gemm(a: Tensor, a_s: Tensor, b: Tensor, b_s: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    fn = _triton().fp8_gemm_triton if use_triton(a) else ref.fp8_gemm_ref
    return fn(a, a_s, b, b_s, out_dtype)


def fp8_linear(
    x: Tensor, weight_fp8: Tensor, weight_scale_inv: Tensor, scale_fmt: str | None = None
) -> Tensor:
    """y = x @ dequant(weight).T through W8A8: quantize x per 128-block, then the block-scaled GEMM.

    K that is not a multiple of 128 (tiny test models) is zero-padded on both x and the weight: zeros leave
    every block's amax and every dot product unchanged, and weight_scale_inv already has ceil(K/128)
    columns, so it covers the padded K as is.
    """
    pad = -x.shape[-1] % BLOCK_SIZE
    if pad:
        x_in, weight_fp8 = F.pad(x, (0, pad)), F.pad(weight_fp8, (0, pad))
    else:
        x_in = x
    x_q, x_s = act_quant(x_in, BLOCK_SIZE, scale_fmt)
    return fp8_gemm(x_q, x_s, weight_fp8, weight_scale_inv, out_dtype=x.dtype)


def _mla_triton() -> Any:
    # Lazy for the same reasons as `_triton`, and separate so MLA decode does not pull in the FP8 kernels.
    from moelaunch.kernels import mla_decode_triton, triton_ops

    return triton_ops.entry(mla_decode_triton)


def paged_mla_decode(
    q_latent: Tensor,
    q_pe: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    cache_scales: Tensor | None = None,
    starts: Tensor | None = None,
    fp8_as: torch.dtype = torch.float32,
) -> Tensor:
    """Paged MLA decode attention in latent space: [R, H, C] (see `mla_decode_reference`); an fp8 cache
    comes with its scales, a sliding window with each row's first position. fp8_as: the float dtype an
    fp8 cache stands in for (the model's cache dtype): bf16 lets the CPU kernel read its values in bf16."""
    args = (q_latent, q_pe, cache, block_table, seq_lens, scale)
    if use_triton(q_latent):
        return _mla_triton().paged_mla_decode_triton(*args, cache_scales, starts)
    if paged_mla_decode_on_cpu(q_latent):
        return mla_cpu.paged_mla_decode_cpu(*args, starts, cache_scales, fp8_as)
    return mla_ref.paged_mla_decode_ref(*args, cache_scales, starts)


def grouped_linear(x: Tensor, weight: Tensor, offsets: Tensor, gated: bool = False) -> Tensor:
    """Rows offsets[g]:offsets[g+1] of x [T, K] times weight[g].T ([G, N, K]) -> [T, N]: the CPU kernel
    where `selection.grouped_linear_on_cpu` says so, else its torch twin. gated: each weight[g] is
    [gate; up] and the result silu(gate product) * up product, [T, N / 2]."""
    fn = linear_cpu.grouped_linear_cpu if grouped_linear_on_cpu(x, weight) else linear_ref.grouped_linear_ref
    return fn(x, weight, offsets, gated)


@functools.cache
def _head_offsets_made(heads: int, rows: int) -> Tensor:
    return torch.arange(0, heads * rows + 1, rows)


@torch.compiler.assume_constant_result  # traced as a constant of the graph, as `one_group`
def _head_offsets(heads: int, rows: int) -> Tensor:
    return _head_offsets_made(heads, rows)


def per_head_linear(x: Tensor, stack: Tensor) -> Tensor:
    """x [R, H, K] times stack[h]^T ([H, N, K]) for each head h -> [R, H, N], in x's dtype: read in place
    by the AMX tiles where they take the call, else as the heads = groups of `grouped_linear` (a
    transposed copy of x in, a transposed view out)."""
    rows, heads, k = x.shape
    if linear_cpu.per_head_tiles_take(x, stack):
        return linear_cpu.per_head_linear_cpu(x, stack)
    grouped = x.transpose(0, 1).reshape(heads * rows, k)
    out = grouped_linear(grouped, stack, _head_offsets(heads, rows))
    return out.view(heads, rows, -1).transpose(0, 1)


@functools.cache
def _one_group_made(rows: int) -> Tensor:
    return torch.tensor([0, rows])


@torch.compiler.assume_constant_result  # traced as a constant of the graph, not rebuilt per call
def one_group(rows: int) -> Tensor:
    """Offsets [0, rows] (never written to): made once per row count, not once per layer and step."""
    return _one_group_made(rows)


def linear(x: Tensor, weight: Tensor, gated: bool = False) -> Tensor:
    """x @ weight.T for a plain float weight: the CPU kernel for few rows, F.linear otherwise (a bf16
    weight under fp32 rows: a bf16 GEMM, which oneDNN runs on AMX where the CPU has it). gated: weight is
    [gate; up] and the result silu(x @ gate.T) * (x @ up.T), in the kernel's epilogue where it runs.

    The result comes in x's dtype, except gated after a bf16 GEMM: there it stays bf16, which the next
    projection reads anyway (widening the GEMM's [rows, 2 I] output for the gate cost a third of a
    prompt step's time in conversions)."""
    rows = math.prod(x.shape[:-1])
    if not uses_grouped_linear_kernel(x, rows, weight):
        if onednn_gemm(weight):  # its rows rounded up, so that oneDNN's compiled kernels are reused
            flat = linear_padded(x.reshape(rows, x.shape[-1]), weight)
            out = flat.view(*x.shape[:-1], flat.shape[-1])
        else:
            out = F.linear(x.to(weight.dtype), weight)
        if gated:
            return silu_mul(*out.chunk(2, dim=-1))
        return out.to(x.dtype)
    flat = x.reshape(rows, x.shape[-1])
    out = linear_cpu.grouped_linear_cpu(flat, weight.unsqueeze(0), one_group(rows), gated)
    return out.view(*x.shape[:-1], out.shape[-1])
