"""Block-scaled FP8, paged MLA decode and few-row linear kernels: Triton on CUDA; on the CPU C++
kernels for paged MLA decode, few-row linears and the fused per-token steps (`kernels/fused.py`), torch
references for the rest.

The choice is made per call by `moelaunch.kernels.dispatch`.
"""

from __future__ import annotations

from moelaunch.kernels.dispatch import (
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
from moelaunch.kernels.fp8_reference import BLOCK_SIZE, FP8_MAX
from moelaunch.kernels.fused import mla_latent, moe_combine, rms_norm, rotate_tail, silu_mul

__all__ = [
    "BLOCK_SIZE",
    "FP8_MAX",
    "act_quant",
    "fp8_gemm",
    "fp8_linear",
    "grouped_linear",
    "linear",
    "mla_latent",
    "moe_combine",
    "paged_mla_decode",
    "prepare_cpu_kernels",
    "rms_norm",
    "rotate_tail",
    "silu_mul",
    "use_triton",
    "uses_grouped_linear_kernel",
    "weight_dequant",
    "weight_quant",
]
