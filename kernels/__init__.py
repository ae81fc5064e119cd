"""Block-scaled FP8, paged MLA decode and few-row linear kernels: Triton on CUDA; on the CPU C++ kernels
for paged MLA decode and few-row linears, torch references for the rest.

The choice is made per call by `kernels.dispatch`.
"""

from __future__ import annotations

from kernels.dispatch import (
    act_quant,
    fp8_gemm,
    fp8_linear,
    grouped_linear,
    linear,
    paged_mla_decode,
    prepare_cpu_kernels,
    use_triton,
    uses_grouped_linear_kernel,
    weight_dequant,
    weight_quant,
)
from kernels.fp8_reference import BLOCK_SIZE, FP8_MAX

__all__ = [
    "BLOCK_SIZE",
    "FP8_MAX",
    "act_quant",
    "fp8_gemm",
    "fp8_linear",
    "grouped_linear",
    "linear",
    "paged_mla_decode",
    "prepare_cpu_kernels",
    "use_triton",
    "uses_grouped_linear_kernel",
    "weight_dequant",
    "weight_quant",
]
