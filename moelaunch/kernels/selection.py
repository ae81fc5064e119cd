"""Which implementation runs a kernel call, decided from its tensors' device, dtype, layout and size.

- Triton: every call on CUDA tensors. CPU tensors go to Triton only when MOELAUNCH_TRITON_ON_CPU=1 and
  TRITON_INTERPRET=1 are both set (its interpreter, for tests).
- The C++ CPU kernels (csrc/, compiled for this machine's instruction set by `cpu_extension`): paged MLA
  decode, few-row linear layers and the fused per-token steps, on fp32 CPU tensors outside autograd whose
  layout the kernel reads (their rows contiguous). Off with MOELAUNCH_CPU_KERNELS=0 or without a compiler.
  Integer-weight linears (INT8, INT4, W8A8) take them for any number of rows. Each kernel call runs the
  best instruction-set path the CPU has (AVX-512 + BF16, AVX-512 + VNNI, AVX2, scalar), or a slower one
  forced by MOELAUNCH_CPU_ISA: `cpu_isa_path`.
- The torch references (or F.linear): every other call, and weight quantization everywhere (done once, at
  conversion or load, never on the hot path).

The entry points in `dispatch`, `int_dispatch` and `fused` ask these functions and call what they say.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from moelaunch.kernels import cpu_extension
from moelaunch.kernels.triton_interpreter import interpreting

# Rows up to which the CPU kernel beats BLAS on one weight (measured with cold weights on an AVX2 core:
# it streams the weight once; BLAS packs it first and only wins once enough rows reuse each packed tile).
LINEAR_KERNEL_MAX_ROWS = 32
# The same for bf16 weights where the AMX tiles multiply them (csrc/grouped_linear_amx.h): against
# oneDNN's bf16 GEMM, which repacks the weight on every call, 1.04-2.8x at 8-64 rows on the bench models'
# projections, even at 128 (benchmarks/bf16_kernels.py; docs/benchmarks.md, issue 30).
AMX_LINEAR_MAX_ROWS = 64
# The C++ kernels' instruction-set paths (csrc/cpu_isa.h), in the order of their numbers: avx512_bf16
# adds bf16 dot products (vdpbf16ps) to avx512, amx the AMX tiles to that; MOELAUNCH_CPU_ISA=avx512
# forces the widening fp32 path.
CPU_ISA_PATHS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")


def use_triton(t: Tensor) -> bool:
    """Whether the call on `t` runs Triton (FP8, INT8/INT4 and paged MLA decode have Triton kernels)."""
    if t.is_cuda:
        return True
    return os.environ.get("MOELAUNCH_TRITON_ON_CPU") == "1" and interpreting()


# Traced as its value: torch.compile must not trace the build (files, locks, the compiler).
@torch.compiler.assume_constant_result
def prepare_cpu_kernels() -> bool:
    """Build the CPU kernels now (a minute the first time on a machine, then cached), so that the first
    decode step does not stall while peers wait in a collective. True when they are usable."""
    return cpu_extension.module() is not None


def int_linear_on_cpu(x: Tensor) -> bool:
    """Whether the integer-weight kernels take x @ W^T: x on the CPU in fp32 or bf16 (computed in fp32),
    outside autograd, any number of rows (the torch path dequantizes the whole weight on every call)."""
    if use_triton(x) or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    return not (x.requires_grad and torch.is_grad_enabled()) and prepare_cpu_kernels()


@functools.cache
def cpu_isa_path() -> int:
    """The C++ kernels' instruction-set path: the fastest this machine's build has, unless
    MOELAUNCH_CPU_ISA names a slower one (scalar | avx2 | avx512 | avx512_bf16 | amx), so that a machine
    can run and test its fallbacks.

    Decided once per process (it is asked on every projection); after changing MOELAUNCH_CPU_ISA, call
    cpu_isa_path.cache_clear()."""
    best = cpu_extension.require().cpu_isa_best_path()
    forced = os.environ.get("MOELAUNCH_CPU_ISA")
    if forced is None:
        return best
    if forced not in CPU_ISA_PATHS:
        raise ValueError(f"MOELAUNCH_CPU_ISA={forced!r} must be one of {', '.join(CPU_ISA_PATHS)}")
    if CPU_ISA_PATHS.index(forced) > best:
        raise ValueError(
            f"MOELAUNCH_CPU_ISA={forced}: this CPU (or compiler) has no {forced} path; the best here is "
            f"{CPU_ISA_PATHS[best]}"
        )
    return CPU_ISA_PATHS.index(forced)


@torch.compiler.assume_constant_result  # traced as its value (a cached one: the build is not traceable)
def kernel_isa_path() -> int:
    """`cpu_isa_path()`, for the kernel wrappers to pass on each call."""
    return cpu_isa_path()


def bf16_dot_products() -> bool:
    """Whether the C++ kernels multiply bf16 pairs (AVX512-BF16, or AMX above it). Then fp32 rows meeting
    bf16 weights or a bf16 cache are rounded to bf16 first, as oneDNN's bf16 GEMM rounds its input for
    many rows: half the bytes, twice the products per instruction, within the bf16 model's own rounding."""
    return kernel_isa_path() >= CPU_ISA_PATHS.index("avx512_bf16")


def amx_tiles() -> bool:
    """Whether the C++ kernels multiply bf16 through the AMX tiles (the amx path)."""
    return kernel_isa_path() >= CPU_ISA_PATHS.index("amx")


def amx_tiles_fit(weight: Tensor, width: int) -> bool:
    """Whether the AMX tiles multiply rows by `weight` ([..., N, K]) into `width` outputs per row: a bf16
    weight, K and the width in whole tiles (32 and 16 values: csrc/grouped_linear_amx.h's `fits`), on the
    amx path."""
    return (
        weight.dtype == torch.bfloat16 and weight.is_cpu and weight.shape[-1] % 32 == 0
        and width % 16 == 0 and amx_tiles()
    )  # fmt: skip


def bf16_gemm_units(x: Tensor) -> bool:
    """Whether x sits on a CPU that multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16), where oneDNN's
    bf16 GEMM beats its fp32 one: fp32 rows meeting bf16 weights go in as bf16 there (the absorbed MLA
    products at 64 rows: 2.6-3.2x on AMX) instead of meeting an fp32 copy of the weights."""
    return x.device.type == "cpu" and _cpu_has_bf16_units()


@torch.compiler.assume_constant_result  # a constant of a traced step: tracing cannot read /proc/cpuinfo
def _cpu_has_bf16_units() -> bool:
    flags = cpu_extension.cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def _cpu_kernel_takes(*fp32: Tensor, weight: Tensor | None = None) -> bool:
    """Whether the C++ kernels take these tensors: on the CPU, fp32 (a linear layer's `weight` fp32 or
    bf16), none under autograd (the kernels have no backward), and the kernels built."""
    # Loops rather than all(): this runs on every linear layer and per-token step of a decode step.
    grad = torch.is_grad_enabled()
    for t in fp32:
        if t.is_cuda or t.dtype != torch.float32 or (grad and t.requires_grad):
            return False
    if weight is not None and (
        weight.is_cuda
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or (grad and weight.requires_grad)
    ):
        return False
    return prepare_cpu_kernels()


def cache_store_on_cpu(pool: Tensor) -> bool:
    """Whether the C++ stores write into (and the fp8 reads read from) a paged cache pool: one in CPU
    memory, the kernels built."""
    return pool.device.type == "cpu" and prepare_cpu_kernels()


def row_reductions_on_cpu(x: Tensor) -> bool:
    """Whether a step's logits [R, V] take the row-reduction kernel: fp32 rows with a unit stride."""
    return x.dim() == 2 and x.shape[-1] > 0 and x.stride(-1) == 1 and _cpu_kernel_takes(x)


def paged_mla_decode_on_cpu(q_latent: Tensor) -> bool:
    """Whether paged MLA decode takes the C++ kernel: it reads fp32, bf16 and fp8 caches (the last with
    their scales)."""
    return not use_triton(q_latent) and prepare_cpu_kernels()


def grouped_linear_on_cpu(x: Tensor, weight: Tensor) -> bool:
    """Whether the grouped-linear kernel takes x @ weight.T for any number of rows. bf16 rows are taken
    too (multiplied in bf16 pairs against a bf16 weight where the CPU has AVX512-BF16, else widened to
    fp32) and rounded once on the way out: at decode sizes oneDNN's bf16 GEMM cost several times the
    kernel's read of the bf16 weight."""
    if x.dtype == torch.bfloat16 and not x.is_cuda and not (x.requires_grad and torch.is_grad_enabled()):
        return _cpu_kernel_takes(weight=weight)
    return _cpu_kernel_takes(x, weight=weight)


def uses_grouped_linear_kernel(
    x: Tensor, max_rows: int, weight: Tensor, row_limit: int | None = None
) -> bool:
    """Whether `linear`/`grouped_linear` take the CPU kernel for groups of at most `max_rows` rows: up to
    LINEAR_KERNEL_MAX_ROWS, or AMX_LINEAR_MAX_ROWS for a bf16 weight the AMX tiles multiply.

    Callers with a different trade-off pass their own `row_limit` (grouped experts: the alternative
    pads every group to the largest).
    """
    if not grouped_linear_on_cpu(x, weight):
        return False
    if row_limit is None:
        row_limit = AMX_LINEAR_MAX_ROWS if amx_tiles_fit(weight, weight.shape[-2]) else LINEAR_KERNEL_MAX_ROWS
    return max_rows <= row_limit


# The fused per-token steps (`fused`): a tensor whose stride is checked here goes to the kernel as it is
# and must have contiguous rows; the others are made contiguous on the way.


def rms_norm_on_cpu(x: Tensor, weight: Tensor) -> bool:
    return x.dim() >= 2 and x.stride(-1) == 1 and _cpu_kernel_takes(x, weight)


def mla_latent_on_cpu(latent: Tensor, weight: Tensor, cos: Tensor, sin: Tensor) -> bool:
    return latent.stride(-1) == 1 and _cpu_kernel_takes(latent, weight, cos, sin)


def mla_input_norms_on_cpu(
    q_a: Tensor, q_weight: Tensor, latent: Tensor, weight: Tensor, cos: Tensor, sin: Tensor
) -> bool:
    return (
        q_a.dim() == 2 and q_a.stride(-1) == 1 and rms_norm_on_cpu(q_a, q_weight)
        and mla_latent_on_cpu(latent, weight, cos, sin)
    )  # fmt: skip


def rotate_tail_on_cpu(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    return x.stride(-1) == 1 and _cpu_kernel_takes(x, cos, sin)


def silu_mul_on_cpu(gate: Tensor, up: Tensor) -> bool:
    """fp32 rows, or bf16 ones (a bf16 GEMM's output on its way to the next one)."""
    if gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1 or gate.dtype != up.dtype:
        return False
    if gate.dtype == torch.bfloat16:  # as weights: the dtype check _cpu_kernel_takes makes for bf16
        return _cpu_kernel_takes(weight=gate) and _cpu_kernel_takes(weight=up)
    return _cpu_kernel_takes(gate, up)


def moe_combine_on_cpu(y: Tensor, weights: Tensor, base: Tensor | None, residual: Tensor | None) -> bool:
    extra = [t for t in (base, residual) if t is not None]
    return _cpu_kernel_takes(y, weights, *extra) and all(t.dim() == 2 and t.stride(-1) == 1 for t in extra)


def add_rms_norm_on_cpu(x: Tensor, y: Tensor, weight: Tensor) -> bool:
    return (
        x.dim() == 2 and x.shape == y.shape and x.stride(-1) == 1 and y.stride(-1) == 1
        and _cpu_kernel_takes(x, y, weight)
    )  # fmt: skip


def moe_route_on_cpu(logits: Tensor, bias: Tensor | None) -> bool:
    if bias is None:
        return _cpu_kernel_takes(logits)
    return _cpu_kernel_takes(logits, bias) and bias.is_contiguous()


def moe_gate_on_cpu(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """x fp32 [T, D] with few rows (where `linear` takes the kernel too: BLAS wins on prompts) and a
    contiguous router weight the grouped-linear kernel reads (fp32 or bf16)."""
    return (
        x.dim() == 2 and x.is_contiguous() and weight.is_contiguous()
        and uses_grouped_linear_kernel(x, x.shape[0], weight) and moe_route_on_cpu(x, bias)
    )  # fmt: skip


def moe_sort_rows_on_cpu(x: Tensor, ids: Tensor) -> bool:
    return x.dim() == 2 and x.is_contiguous() and ids.is_contiguous() and _cpu_kernel_takes(x)
