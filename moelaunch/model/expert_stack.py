"""One projection of every local routed expert, stacked on a new first dimension, for the grouped kernels
(`MoE.run_grouped_kernel`, `MoE.run_moe_kernel`): a float weight [E, N, K], block-FP8 weights with their
128x128 block scales, or integer weights (`model/linear.py`) with their scales and int4 zero points
stacked alike. Each expert's Linear then holds views of the stack."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moelaunch import kernels
from moelaunch.model.linear import Linear
from moelaunch.model.quantization import IntQuant

# A Linear's tensors, as (attribute, stack field), in stacking order.
_TENSORS = (
    ("weight", "weight"),
    ("weight_scale", "scale"),
    ("weight_zero_point", "zero"),
    ("weight_scale_inv", "block_scale"),
)


@dataclass
class ExpertStack:
    weight: Tensor
    scale: Tensor | None = None
    zero: Tensor | None = None
    # Block-FP8: [E, sum of the projections' ceil(N/128), ceil(K/128)]; each projection's block rows start
    # a new scale row, as in the checkpoint.
    block_scale: Tensor | None = None
    quant: IntQuant | None = None

    @classmethod
    @torch.no_grad()
    def of(cls, experts: list[list[Linear]]) -> ExpertStack | None:
        """experts[e]: the Linears whose outputs expert e's stacked projection concatenates (e.g. its gate
        and up projections). None when they cannot stack: mixed formats, or 1-byte weights without block
        scales."""
        first = experts[0][0]
        if any(
            lin.quant != first.quant or lin.weight.dtype != first.weight.dtype for e in experts for lin in e
        ):
            return None
        if first.quant is None and first.weight.element_size() < 2 and first.weight_scale_inv is None:
            return None
        tensors = {}
        for attr, field in _TENSORS:
            if getattr(first, attr) is not None:
                tensors[field] = torch.stack([torch.cat([getattr(lin, attr) for lin in e]) for e in experts])
        stack = cls(**tensors, quant=first.quant)
        for attr, field in _TENSORS:
            if field not in tensors:
                continue
            for e, projections in enumerate(experts):
                start = 0  # each tensor's own rows (block-FP8 scales: one per 128 weight rows)
                for lin in projections:
                    rows = slice(start, start + getattr(lin, attr).shape[0])
                    start = rows.stop
                    view = tensors[field][e, rows]
                    setattr(lin, attr, nn.Parameter(view, requires_grad=False) if attr == "weight" else view)
        return stack

    def linear(self, x: Tensor, gated: bool = False) -> Tensor:
        """x [..., K] through a one-expert stack (a dense MLP's [gate; up])."""
        rows = x.reshape(-1, x.shape[-1])
        out = self.grouped(rows, kernels.one_group(rows.shape[0]), gated)
        return out.view(*x.shape[:-1], out.shape[-1])

    def grouped(self, x: Tensor, offsets: Tensor, gated: bool = False) -> Tensor:
        """Rows offsets[e]:offsets[e+1] of x through expert e's projection. gated (a [gate; up] stack):
        silu(gate) * up, in the kernels' epilogue."""
        if self.quant is None:
            return kernels.grouped_linear(x, self.weight, offsets, gated)
        if self.quant.method == "int4":
            return kernels.int4_grouped_linear(
                x, self.weight, self.scale, self.zero, offsets, self.quant.group_size, gated
            )
        if self.quant.quantize_activations:
            return kernels.w8a8_grouped_linear(x, self.weight, self.scale, offsets, gated)
        return kernels.int8_grouped_linear(x, self.weight, self.scale, offsets, gated)
