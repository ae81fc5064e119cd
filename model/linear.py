"""The one linear layer every projection goes through; it picks the kernel by the weight's format.

Plain weights (fp32/bf16) use F.linear, or on the CPU a kernel for decode-sized inputs (few rows).
Block-FP8 weights (float8_e4m3fn plus a `weight_scale_inv` of 128x128 block scales, as in DeepSeek's
checkpoints) run the W8A8 path: activations quantized per 1x128 block, then a block-scaled GEMM with
fp32 accumulation.
"""

from __future__ import annotations

import torch
from torch import nn

from moelaunch import kernels


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        # Set by the loader for block-FP8 weights; a None buffer stays out of the state dict.
        self.register_buffer("weight_scale_inv", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float8_e4m3fn:
            assert self.weight_scale_inv is not None, "FP8 weight loaded without its weight_scale_inv"
            return kernels.fp8_linear(x, self.weight, self.weight_scale_inv)
        return kernels.linear(x, self.weight)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a plain matrix in `dtype` (for the absorbed MLA form, which folds it)."""
        if self.weight.dtype == torch.float8_e4m3fn:
            return kernels.weight_dequant(self.weight, self.weight_scale_inv, out_dtype=dtype)
        return self.weight.to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, dtype={self.weight.dtype}"
