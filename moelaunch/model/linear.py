"""The one linear layer every projection goes through; it picks the kernel by the weight's format.

Plain weights (fp32/bf16) use F.linear, or on the CPU a kernel for decode-sized inputs (few rows).
Block-FP8 weights (float8_e4m3fn plus a `weight_scale_inv` of 128x128 block scales, as in DeepSeek's
checkpoints) run the W8A8 path: activations quantized per 1x128 block, then a block-scaled GEMM with
fp32 accumulation.

Integer weights (`model/quantization.py`; `launch convert quantize-int8 | quantize-w8a8 | quantize-int4`
writes them, `quantization=` makes them at load). Checkpoint tensors of a projection P [N, K]:
- int8 and w8a8: `P.weight` int8 [N, K] and `P.weight_scale` fp32 [N], one symmetric scale per output
  channel (W = weight * scale); w8a8 also quantizes activations per token and runs an int8 GEMM with int32
  accumulation, int8 runs the weight-only kernel.
- int4: `P.weight_packed` uint8 [N, K/2] (column 2j in the low nibble of byte j, 2j+1 in the high one),
  `P.weight_scale` fp32 [N, ceil(K/G)] and `P.weight_zero_point` uint8 [N, ceil(K/G)] for groups of G
  (128) input columns: W = (q - zero) * scale. Here `weight` holds the packed bytes. G is per projection
  (`quant.group_size`): a tensor-parallel slice of the input columns holds its rows' groups as narrower
  local ones (`quantization.int4_column_slice`).
"""

from __future__ import annotations

import torch
from torch import nn

from moelaunch import kernels
from moelaunch.model.quantization import IntQuant
from moelaunch.model.shard_spec import ShardSpec


class Linear(nn.Module):
    """`shard_spec`: the slice of the checkpoint's weight this layer holds (a tensor-parallel rank's
    share); None: the whole weight."""

    def __init__(self, in_features: int, out_features: int, shard_spec: ShardSpec | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.shard_spec = shard_spec
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        # Set by the loader for quantized weights; a None buffer stays out of the state dict.
        self.register_buffer("weight_scale_inv", None)  # block-FP8
        self.register_buffer("weight_scale", None)  # int8: per channel; int4: per group
        self.register_buffer("weight_zero_point", None)  # int4
        self.quant: IntQuant | None = None
        # dense_weight's last result for a quantized weight: (dtype, weight storage, dense matrix).
        self._dense: tuple[torch.dtype, int, torch.Tensor] | None = None

    def set_quantized(self, tensors: dict[str, torch.Tensor], quant: IntQuant) -> None:
        """Hold a projection's integer tensors (the keys of `quantization.quantize_weight`)."""
        weight = tensors["weight_packed"] if quant.method == "int4" else tensors["weight"]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = tensors["weight_scale"]
        self.weight_zero_point = tensors.get("weight_zero_point")
        self.quant = quant

    def forward(self, x: torch.Tensor, act_amax: torch.Tensor | None = None) -> torch.Tensor:
        """act_amax (W8A8 only): each row's amax to quantize x with, when x is a slice of wider rows."""
        if self.weight.dtype == torch.float8_e4m3fn:
            assert self.weight_scale_inv is not None, "FP8 weight loaded without its weight_scale_inv"
            return kernels.fp8_linear(x, self.weight, self.weight_scale_inv)
        if self.quant is None:
            return kernels.linear(x, self.weight)
        if self.quant.method == "int4":
            return kernels.int4_linear(
                x, self.weight, self.weight_scale, self.weight_zero_point, self.quant.group_size
            )
        if self.quant.quantize_activations:
            return kernels.w8a8_linear(x, self.weight, self.weight_scale, act_amax)
        return kernels.int8_linear(x, self.weight, self.weight_scale)

    def is_plain(self) -> bool:
        """Whether the weight is a plain float matrix (not block-FP8, not integer)."""
        return self.quant is None and self.weight.dtype != torch.float8_e4m3fn

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a plain matrix in `dtype` (for the absorbed MLA form, which folds it).

        A quantized weight is dequantized once and kept (for as long as its storage is the same): the
        absorbed form asks for kv_b_proj on every decode step, and dequantizing it each time cost more
        than the rest of the layer (INT4 at batch 1)."""
        if self.is_plain():
            return self.weight.to(dtype)
        if self._dense is None or self._dense[0] != dtype or self._weight_replaced():
            self._dense = (dtype, self.weight.data_ptr(), self._dequantized(dtype))
        return self._dense[2]

    def _weight_replaced(self) -> bool:
        """Whether the weight's storage changed since dense_weight kept its matrix. Not asked while
        compiling (torch.compile cannot compare storages): a compiled step keeps the matrix it traced with
        (the absorbed MLA form asks for kv_b_proj's, which nothing replaces while serving)."""
        assert self._dense is not None
        return not torch.compiler.is_compiling() and self._dense[1] != self.weight.data_ptr()

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.weight.dtype == torch.float8_e4m3fn:
            return kernels.weight_dequant(self.weight, self.weight_scale_inv, out_dtype=dtype)
        assert self.quant is not None
        if self.quant.method == "int4":
            return kernels.int4_dequant(
                self.weight, self.weight_scale, self.weight_zero_point, self.quant.group_size, dtype
            )
        return kernels.int8_dequant(self.weight, self.weight_scale, dtype)

    def extra_repr(self) -> str:
        method = f", quant={self.quant.method}" if self.quant else ""
        return f"in={self.in_features}, out={self.out_features}, dtype={self.weight.dtype}{method}"
