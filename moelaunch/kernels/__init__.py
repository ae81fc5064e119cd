"""Block-scaled FP8, INT8/INT4 weight, paged MLA decode, grouped MoE and few-row linear kernels: Triton
on CUDA; on the CPU C++ kernels for paged MLA decode (fp32, bf16 and fp8 caches), few-row linears,
integer-weight linears (`int_linear_cpu`) and the fused per-token steps (`kernels/fused.py`), torch
references for the rest.

`selection` says which implementation runs a call, from its tensors' device, dtype and layout; the entry
points (`dispatch`, `int_dispatch`, `fused`, `moe_grouped`) ask it on every call.
"""

from __future__ import annotations

from moelaunch.kernels.dispatch import (
    act_quant,
    fp8_gemm,
    fp8_linear,
    grouped_linear,
    linear,
    one_group,
    paged_mla_decode,
    per_head_linear,
    weight_dequant,
    weight_quant,
)
from moelaunch.kernels.fp8_reference import BLOCK_SIZE, FP8_MAX
from moelaunch.kernels.fused import (
    add_rms_norm,
    mla_input_norms,
    mla_latent,
    moe_combine,
    moe_gate,
    moe_route,
    moe_sort_rows,
    rms_norm,
    rotate_tail,
    silu_mul,
)
from moelaunch.kernels.gemm_rows import onednn_gemm, padded_copy, padded_rows
from moelaunch.kernels.int4_reference import INT4_GROUP_SIZE
from moelaunch.kernels.int_dispatch import (
    int4_dequant,
    int4_grouped_linear,
    int4_linear,
    int4_weight_quant,
    int8_act_quant,
    int8_dequant,
    int8_grouped_linear,
    int8_linear,
    int8_weight_quant,
    w8a8_grouped_linear,
    w8a8_linear,
)
from moelaunch.kernels.kv_fp8 import FP8_KV_DTYPE, SCALES_PER_TOKEN, dequantize_latent, quantize_latent
from moelaunch.kernels.moe_grouped import moe_experts, moe_grouped_gemm
from moelaunch.kernels.paged_store import read_fp8_latent, store_fp8_latent, store_rows
from moelaunch.kernels.row_reductions import row_argmax, row_argmax_and_finite, rows_finite
from moelaunch.kernels.selection import (
    amx_tiles_fit,
    bf16_gemm_units,
    grouped_linear_on_cpu,
    int_linear_on_cpu,
    prepare_cpu_kernels,
    use_triton,
    uses_grouped_linear_kernel,
)

__all__ = [
    "amx_tiles_fit",
    "add_rms_norm",
    "bf16_gemm_units",
    "BLOCK_SIZE",
    "FP8_KV_DTYPE",
    "FP8_MAX",
    "INT4_GROUP_SIZE",
    "SCALES_PER_TOKEN",
    "act_quant",
    "dequantize_latent",
    "fp8_gemm",
    "fp8_linear",
    "grouped_linear",
    "grouped_linear_on_cpu",
    "int4_dequant",
    "int4_grouped_linear",
    "int4_linear",
    "int4_weight_quant",
    "int8_act_quant",
    "int8_dequant",
    "int8_grouped_linear",
    "int8_linear",
    "int8_weight_quant",
    "int_linear_on_cpu",
    "linear",
    "per_head_linear",
    "mla_input_norms",
    "mla_latent",
    "moe_combine",
    "moe_experts",
    "moe_grouped_gemm",
    "moe_gate",
    "moe_route",
    "moe_sort_rows",
    "one_group",
    "paged_mla_decode",
    "prepare_cpu_kernels",
    "quantize_latent",
    "rms_norm",
    "rotate_tail",
    "silu_mul",
    "read_fp8_latent",
    "store_fp8_latent",
    "store_rows",
    "use_triton",
    "onednn_gemm",
    "padded_copy",
    "padded_rows",
    "row_argmax",
    "row_argmax_and_finite",
    "rows_finite",
    "uses_grouped_linear_kernel",
    "w8a8_grouped_linear",
    "w8a8_linear",
    "weight_dequant",
    "weight_quant",
]
