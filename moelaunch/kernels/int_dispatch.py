"""The INT8 / INT4 weight entry points: Triton or the torch reference, as `selection.use_triton` says;
quantizing and dequantizing weights (conversion, load) always take the references.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from moelaunch.kernels import int4_reference as int4_ref
from moelaunch.kernels import int8_reference as int8_ref
from moelaunch.kernels.int4_reference import INT4_GROUP_SIZE
from moelaunch.kernels.selection import use_triton


def _int8_triton() -> ModuleType:
    # Imported on first use, like dispatch._triton: CPU-only runs never load Triton.
    from moelaunch.kernels import int8_triton

    return int8_triton


def _int4_triton() -> ModuleType:
    from moelaunch.kernels import int4_triton

    return int4_triton


def int8_weight_quant(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (int8 [N, K], fp32 per-output-channel scale [N])."""
    return int8_ref.int8_weight_quant_ref(w)


def int8_dequant(q: Tensor, s: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    return int8_ref.int8_dequant_ref(q, s, out_dtype)


def int8_linear(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    """Weight-only INT8: x @ (q * s[:, None]).T, in x's dtype."""
    fn = _int8_triton().int8_linear_triton if use_triton(x) else int8_ref.int8_linear_ref
    return fn(x, q, s)


def int8_act_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (int8 [..., K], fp32 per-token scale [...])."""
    fn = _int8_triton().int8_act_quant_triton if use_triton(x) else int8_ref.int8_act_quant_ref
    return fn(x)


def w8a8_linear(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    """W8A8: x quantized per token, int8 GEMM with int32 accumulation, then token and channel scales."""
    fn = _int8_triton().w8a8_linear_triton if use_triton(x) else int8_ref.w8a8_linear_ref
    return fn(x, q, s)


def int4_weight_quant(w: Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[Tensor, Tensor, Tensor]:
    """w [N, K] -> (packed uint8 [N, K/2], fp32 scale [N, groups], uint8 zero point [N, groups])."""
    return int4_ref.int4_weight_quant_ref(w, group_size)


def int4_dequant(
    packed: Tensor, scale: Tensor, zero: Tensor, group_size: int, out_dtype: torch.dtype | None = None
) -> Tensor:
    return int4_ref.int4_dequant_ref(packed, scale, zero, group_size, out_dtype)


def int4_linear(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_size: int) -> Tensor:
    """Weight-only INT4, group-wise: x @ dequant(W).T, the weight unpacked inside the kernel on CUDA."""
    fn = _int4_triton().int4_linear_triton if use_triton(x) else int4_ref.int4_linear_ref
    return fn(x, packed, scale, zero, group_size)
