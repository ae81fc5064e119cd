"""Block-scaled FP8 kernels: Triton on CUDA, torch references on the CPU (see `kernels.dispatch`)."""

from __future__ import annotations

from kernels.dispatch import act_quant, fp8_gemm, fp8_linear, use_triton, weight_dequant, weight_quant
from kernels.fp8_reference import BLOCK_SIZE, FP8_MAX

__all__ = [
    "BLOCK_SIZE",
    "FP8_MAX",
    "act_quant",
    "fp8_gemm",
    "fp8_linear",
    "use_triton",
    "weight_dequant",
    "weight_quant",
]
