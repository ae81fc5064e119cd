"""The routed experts of one MoE layer over rows sorted by expert, with device offsets: one grouped GEMM
per projection (Triton where `selection.use_triton` says so, else the torch reference), SiLU gating in
the gate/up product's epilogue. Plain float weights (bf16 on a GPU) or block-FP8 W8A8, whose activations
are quantized once per projection over all rows, not once per expert."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from moelaunch.kernels import moe_grouped_reference as ref
from moelaunch.kernels.dispatch import act_quant
from moelaunch.kernels.fp8_reference import BLOCK_SIZE
from moelaunch.kernels.selection import use_triton


def _triton() -> Any:
    # Lazy, as in `dispatch`: a CPU-only run never imports Triton.
    from moelaunch.kernels import moe_grouped_triton, triton_ops

    return triton_ops.entry(moe_grouped_triton)


def moe_grouped_gemm(
    x: Tensor,
    offsets: Tensor,
    weight: Tensor,
    weight_scale: Tensor | None = None,
    silu: bool = False,
    row_weights: Tensor | None = None,
    out_cols: int | None = None,
) -> Tensor:
    """Rows offsets[e]:offsets[e+1] of x [R, K] through expert e's weight[e] ([E, N, K]; with silu,
    [gate; up] rows and silu(gate) * up out) -> [R, out_cols or N] in x's dtype; see moe_grouped_gemm_ref.
    weight_scale: the block-FP8 weights' 128x128 scales; x is then quantized here, once, K zero-padded to
    whole 128-blocks."""
    n = weight.shape[1] // 2 if silu else weight.shape[1]
    x_scale = None
    x_in = x
    if weight_scale is not None:
        pad = -x.shape[1] % BLOCK_SIZE  # tiny test models only: real widths are whole blocks
        x_in, x_scale = act_quant(F.pad(x, (0, pad)) if pad else x)
    fn = _triton().moe_grouped_gemm_triton if use_triton(x) else ref.moe_grouped_gemm_ref
    return fn(x_in, x_scale, offsets, weight, weight_scale, silu, row_weights, out_cols or n, x.dtype)


def moe_experts(
    x: Tensor,
    offsets: Tensor,
    gate_up: Tensor,
    down: Tensor,
    gate_up_scale: Tensor | None = None,
    down_scale: Tensor | None = None,
) -> Tensor:
    """down(silu(gate(x)) * up(x)) for every local expert's rows: two launches (four with FP8's two
    activation quantizations). FP8: the hidden rows come out zero-padded to whole 128-blocks, the
    down projection's quantization blocks."""
    hidden = down.shape[2]
    if down_scale is not None:
        hidden += -hidden % BLOCK_SIZE
    h = moe_grouped_gemm(x, offsets, gate_up, gate_up_scale, silu=True, out_cols=hidden)
    return moe_grouped_gemm(h, offsets, down, down_scale)
