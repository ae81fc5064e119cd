"""The FP8, paged MLA decode and grouped MoE Triton kernels as torch custom ops,
`torch.ops.moelaunch.<name>`, each with a fake implementation, so torch.compile (and CUDA graph capture
of a compiled step) traces through them as one op each. Imported only where Triton runs (`dispatch`
imports it lazily).

As for the CPU kernels (`cpu_ops`), eager calls outside a trace take the launcher function directly;
`entry(module)` gives the one to call. A new launcher follows the same pattern: define an op named after
it calling it, a `register_fake`, and reach its module through `entry`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from moelaunch.kernels import fp8_triton, int4_triton, int8_triton, mla_decode_triton, moe_grouped_triton
from moelaunch.kernels.cpu_ops import traced
from moelaunch.kernels.fp8_reference import FP8_DTYPE


def entry(module: ModuleType) -> Any:
    """`module`'s launchers: their registered ops while traced, else the module itself."""
    return torch.ops.moelaunch if traced() else module


@torch.library.custom_op("moelaunch::act_quant_triton", mutates_args=())
def act_quant_triton(x: Tensor, block_size: int, scale_fmt: str | None) -> tuple[Tensor, Tensor]:
    return fp8_triton.act_quant_triton(x, block_size, scale_fmt)


@act_quant_triton.register_fake
def _(x: Tensor, block_size: int, scale_fmt: str | None) -> tuple[Tensor, Tensor]:
    scales = x.new_empty(*x.shape[:-1], x.shape[-1] // block_size, dtype=torch.float32)
    return x.new_empty(x.shape, dtype=FP8_DTYPE), scales


@torch.library.custom_op("moelaunch::weight_dequant_triton", mutates_args=())
def weight_dequant_triton(w: Tensor, s: Tensor, block_size: int, out_dtype: torch.dtype | None) -> Tensor:
    return fp8_triton.weight_dequant_triton(w, s, block_size, out_dtype)


@weight_dequant_triton.register_fake
def _(w: Tensor, s: Tensor, block_size: int, out_dtype: torch.dtype | None) -> Tensor:
    return w.new_empty(w.shape, dtype=out_dtype or torch.get_default_dtype())


@torch.library.custom_op("moelaunch::fp8_gemm_triton", mutates_args=())
def fp8_gemm_triton(a: Tensor, a_s: Tensor, b: Tensor, b_s: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    return fp8_triton.fp8_gemm_triton(a, a_s, b, b_s, out_dtype)


@fp8_gemm_triton.register_fake
def _(a: Tensor, a_s: Tensor, b: Tensor, b_s: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    return a.new_empty(*a.shape[:-1], b.shape[0], dtype=out_dtype or torch.get_default_dtype())


@torch.library.custom_op("moelaunch::paged_mla_decode_triton", mutates_args=())
def paged_mla_decode_triton(
    q_latent: Tensor,
    q_pe: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    cache_scales: Tensor | None,
    starts: Tensor | None,
) -> Tensor:
    return mla_decode_triton.paged_mla_decode_triton(
        q_latent, q_pe, cache, block_table, seq_lens, scale, cache_scales, starts
    )


@paged_mla_decode_triton.register_fake
def _(q_latent, q_pe, cache, block_table, seq_lens, scale, cache_scales, starts) -> Tensor:
    return torch.empty_like(q_latent)


@torch.library.custom_op("moelaunch::int8_linear_triton", mutates_args=())
def int8_linear_triton(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    return int8_triton.int8_linear_triton(x, q, s)


@int8_linear_triton.register_fake
def _(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], q.shape[0])


@torch.library.custom_op("moelaunch::int8_act_quant_triton", mutates_args=())
def int8_act_quant_triton(x: Tensor, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return int8_triton.int8_act_quant_triton(x, amax)


@int8_act_quant_triton.register_fake
def _(x: Tensor, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("moelaunch::w8a8_linear_triton", mutates_args=())
def w8a8_linear_triton(x: Tensor, q: Tensor, s: Tensor, amax: Tensor | None = None) -> Tensor:
    return int8_triton.w8a8_linear_triton(x, q, s, amax)


@w8a8_linear_triton.register_fake
def _(x: Tensor, q: Tensor, s: Tensor, amax: Tensor | None = None) -> Tensor:
    return x.new_empty(*x.shape[:-1], q.shape[0])


@torch.library.custom_op("moelaunch::int4_linear_triton", mutates_args=())
def int4_linear_triton(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_size: int) -> Tensor:
    return int4_triton.int4_linear_triton(x, packed, scale, zero, group_size)


@int4_linear_triton.register_fake
def _(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_size: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


@torch.library.custom_op("moelaunch::moe_grouped_gemm_triton", mutates_args=())
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
    return moe_grouped_triton.moe_grouped_gemm_triton(
        x, x_scale, offsets, weight, weight_scale, silu, row_weights, out_cols, out_dtype
    )


@moe_grouped_gemm_triton.register_fake
def _(x, x_scale, offsets, weight, weight_scale, silu, row_weights, out_cols, out_dtype) -> Tensor:
    return x.new_empty(x.shape[0], out_cols, dtype=out_dtype)
