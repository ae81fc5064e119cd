"""Plain-torch twin of the grouped MoE GEMM (`moe_grouped_triton`): the same signature and numerics (fp32
inside, `out_dtype` out), and like the kernel no host read of the offsets: every expert's product over
all rows, each row keeping its own expert's (the CPU path of an FP8 model's static decode step, whose
shapes must not depend on the routing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moelaunch.kernels.fp8_reference import BLOCK_SIZE, fp8_gemm_ref
from moelaunch.kernels.fused_reference import pair_numbers, silu_mul_ref


def moe_grouped_gemm_ref(
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
    """Rows offsets[e]:offsets[e+1] of x [R, Kx] through expert e's weight[e] [Nw, Kw] (Kw <= Kx; x's
    columns past Kw are zero) -> [R, out_cols] in out_dtype.

    Block-FP8 (weight_scale [E, ceil(Nw/128), ceil(Kw/128)]): x is e4m3 quantized per 1x128 block with
    x_scale [R, Kx/128], each K-block's product scaled as in `fp8_gemm_ref`. silu: weight[e] is [gate; up]
    (Nw = 2N) and the result silu(x @ gate.T) * (x @ up.T). row_weights [R]: each output row scaled by
    it. Columns past N (out_cols > N) are zero."""
    rows, k_x = x.shape
    expert_of_row = torch.searchsorted(offsets[1:], pair_numbers(rows, x.device), right=True)
    out = x.new_zeros(rows, weight.shape[1], dtype=torch.float32)
    for e in range(weight.shape[0]):
        w = weight[e] if k_x == weight.shape[2] else F.pad(weight[e], (0, k_x - weight.shape[2]))
        if weight_scale is None:
            y = x.float() @ w.float().T
        else:
            # [gate; up]: each half's scales start on a scale row of their own (as the checkpoint has them).
            scales = _scale_halves(weight_scale[e], w.shape[0], silu)
            parts = zip(w.chunk(len(scales)), scales, strict=True)
            y = torch.cat([fp8_gemm_ref(x, x_scale, p, s, torch.float32) for p, s in parts], dim=-1)
        out = torch.where((expert_of_row == e)[:, None], y, out)
    if silu:
        out = silu_mul_ref(*out.chunk(2, dim=-1))
    if row_weights is not None:
        out = out * row_weights.float()[:, None]
    return F.pad(out, (0, out_cols - out.shape[1])).to(out_dtype)


def _scale_halves(scale: Tensor, w_rows: int, silu: bool) -> tuple[Tensor, ...]:
    if not silu:
        return (scale,)
    gate_blocks = -(-(w_rows // 2) // BLOCK_SIZE)
    return scale[:gate_blocks], scale[gate_blocks:]
