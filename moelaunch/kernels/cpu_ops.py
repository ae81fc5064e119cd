"""The C++ CPU kernels (csrc/) as torch ops, `torch.ops.moelaunch.<name>`: each declared here by its
schema with a fake implementation that gives its output's shape and dtype, its CPU implementation
registered by the extension itself when it loads (csrc/bindings.cpp, TORCH_LIBRARY_IMPL). So
torch.compile traces each call as one op, a dispatch mode sees each call as one op, and a compiled step
calls the kernel through torch's C++ dispatcher, with no Python between the graph and the kernel.

Eager calls outside any trace go to the extension's function directly (`cpu_kernel`): even the C++
dispatcher's Python entry costs a few us a call, which small-model decode steps feel at ~60 calls a step.

A new kernel follows the same pattern: bind it in csrc/bindings.cpp (pybind11 and TORCH_LIBRARY_IMPL),
declare its schema here with `_kernel_op` on its fake (output shapes from input shapes only), and call it
through `cpu_kernel("<name>")`. A kernel that writes into an input marks it `Tensor(a!)` in the schema
and returns nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

from moelaunch.kernels import cpu_extension

_LIBRARY = torch.library.Library("moelaunch", "FRAGMENT")


def _kernel_op(schema: str) -> Callable[[Callable], Callable]:
    """Declare `moelaunch::<schema>` and register the decorated function as its fake."""
    _LIBRARY.define(schema)
    return torch.library.register_fake(f"moelaunch::{schema.split('(', 1)[0]}", lib=_LIBRARY)


def _ext() -> ModuleType:
    return cpu_extension.built()


def traced() -> bool:
    """Whether kernel calls must go through the registered ops: torch.compile is tracing, or a
    TorchDispatchMode (fake tensors, an op counter, the sync guard) is watching."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def cpu_kernel(name: str) -> Callable:
    """The C++ kernel `name`: its registered op while traced, else the extension's function. Called once
    the dispatcher has sent the call here (`selection.prepare_cpu_kernels()` loaded the extension, which
    registered the ops' CPU implementations)."""
    if traced():
        return getattr(torch.ops.moelaunch, name)
    return getattr(_ext(), name)


@_kernel_op(
    "grouped_linear_cpu(Tensor x, Tensor weight, Tensor offsets, bool gated=False, int path=-1) -> Tensor"
)
def _(x: Tensor, weight: Tensor, offsets: Tensor, gated: bool = False, path: int = -1) -> Tensor:
    # fp32 whatever x's dtype (fp32 or bf16): the sums are fp32, the caller rounds them.
    return x.new_empty(x.shape[0], weight.shape[1] // (2 if gated else 1), dtype=torch.float32)


@_kernel_op("per_head_linear_cpu(Tensor x, Tensor stack, int path=-1) -> Tensor")
def _(x: Tensor, stack: Tensor, path: int = -1) -> Tensor:
    return x.new_empty(x.shape[0], x.shape[1], stack.shape[1], dtype=torch.float32)


@_kernel_op(
    "paged_mla_decode_cpu(Tensor q_latent, Tensor q_pe, Tensor cache, Tensor block_table, Tensor seq_lens, "
    "float scale, Tensor? starts, int path=-1) -> Tensor"
)
def _(q_latent, q_pe, cache, block_table, seq_lens, scale, starts, path=-1) -> Tensor:
    # fp32 whatever the queries' dtype (fp32 or bf16): the caller rounds it.
    return q_latent.new_empty(q_latent.shape, dtype=torch.float32)


@_kernel_op(
    "paged_mla_decode_fp8_cpu(Tensor q_latent, Tensor q_pe, Tensor cache, Tensor cache_scales, "
    "Tensor block_table, Tensor seq_lens, float scale, Tensor? starts, int path=-1) -> Tensor"
)
def _(q_latent, q_pe, cache, cache_scales, block_table, seq_lens, scale, starts, path=-1) -> Tensor:
    return q_latent.new_empty(q_latent.shape, dtype=torch.float32)


@_kernel_op("rms_norm_cpu(Tensor x, Tensor weight, float eps) -> Tensor")
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_kernel_op(
    "mla_latent_cpu(Tensor(a!) latent, Tensor weight, float eps, Tensor cos, Tensor sin, "
    "bool interleaved) -> ()"
)
def _(latent, weight, eps, cos, sin, interleaved) -> None:
    return None


@_kernel_op(
    "mla_input_norms_cpu(Tensor q_a, Tensor q_weight, float q_eps, Tensor(a!) latent, Tensor weight, "
    "float eps, Tensor cos, Tensor sin, bool interleaved) -> Tensor"
)
def _(q_a, q_weight, q_eps, latent, weight, eps, cos, sin, interleaved) -> Tensor:
    return q_a.new_empty(q_a.shape)


@_kernel_op("rotate_tail_cpu(Tensor(a!) x, Tensor cos, Tensor sin, int p, bool interleaved) -> ()")
def _(x, cos, sin, p, interleaved) -> None:
    return None


@_kernel_op("silu_mul_cpu(Tensor gate, Tensor up) -> Tensor")
def _(gate: Tensor, up: Tensor) -> Tensor:
    return gate.new_empty(gate.shape[0], gate.shape[1])


@_kernel_op(
    "moe_combine_cpu(Tensor y, Tensor slot, Tensor weights, Tensor? base, Tensor? residual) -> Tensor"
)
def _(y: Tensor, slot: Tensor, weights: Tensor, base: Tensor | None, residual: Tensor | None) -> Tensor:
    return y.new_empty(slot.shape[0], y.shape[1])


@_kernel_op("add_rms_norm_cpu(Tensor x, Tensor y, Tensor weight, float eps) -> (Tensor, Tensor)")
def _(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


@_kernel_op(
    "moe_route_cpu(Tensor logits, Tensor? bias, int top_k, int n_groups, int topk_groups, bool sigmoid, "
    "bool normalize, float scale) -> (Tensor, Tensor)"
)
def _(logits, bias, top_k, n_groups, topk_groups, sigmoid, normalize, scale) -> tuple[Tensor, Tensor]:
    rows = logits.shape[0]
    return logits.new_empty(rows, top_k), logits.new_empty(rows, top_k, dtype=torch.long)


@_kernel_op(
    "moe_gate_cpu(Tensor x, Tensor weight, Tensor? bias, int top_k, int n_groups, int topk_groups, "
    "bool sigmoid, bool normalize, float scale) -> (Tensor, Tensor)"
)
def _(x, weight, bias, top_k, n_groups, topk_groups, sigmoid, normalize, scale) -> tuple[Tensor, Tensor]:
    rows = x.shape[0]
    return x.new_empty(rows, top_k), x.new_empty(rows, top_k, dtype=torch.long)


@_kernel_op("moe_sort_rows_cpu(Tensor x, Tensor ids, int n_experts) -> (Tensor, Tensor, Tensor, Tensor)")
def _(x: Tensor, ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    pairs = ids.numel()
    return (x.new_empty(pairs, x.shape[1]), ids.new_empty(pairs), ids.new_empty(n_experts + 1),
            ids.new_empty(ids.shape))  # fmt: skip


def _int_out(x: Tensor, n: int, gated: bool) -> Tensor:
    # x's dtype (fp32 or bf16): the kernels round their fp32 sums once; gated halves [gate; up].
    return x.new_empty(x.shape[0], n // 2 if gated else n)


@_kernel_op(
    "int8_linear_cpu(Tensor x, Tensor q, Tensor scale, Tensor offsets, bool gated, int path) -> Tensor"
)
def _(x: Tensor, q: Tensor, scale: Tensor, offsets: Tensor, gated: bool, path: int) -> Tensor:
    return _int_out(x, q.shape[1], gated)


@_kernel_op(
    "w8a8_linear_cpu(Tensor x, Tensor q, Tensor scale, Tensor offsets, bool gated, int path, "
    "Tensor? row_amax) -> Tensor"
)
def _(x, q, scale, offsets, gated, path, row_amax) -> Tensor:
    return _int_out(x, q.shape[1], gated)


@_kernel_op(
    "int4_linear_cpu(Tensor x, Tensor packed, Tensor scale, Tensor zero, Tensor offsets, int group_size, "
    "bool gated, int path) -> Tensor"
)
def _(x, packed, scale, zero, offsets, group_size, gated, path) -> Tensor:
    return _int_out(x, packed.shape[1], gated)


@_kernel_op("argmax_rows_cpu(Tensor logits) -> (Tensor, Tensor)")
def _(logits: Tensor) -> tuple[Tensor, Tensor]:
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.bool)


@_kernel_op(
    "store_fp8_latent_cpu(Tensor(a!) pool, Tensor(b!) scales, int layer, Tensor slots, Tensor latent, "
    "int c_dim) -> ()"
)
def _(pool, scales, layer, slots, latent, c_dim) -> None:
    return None


@_kernel_op("dequantize_latent_cpu(Tensor values, Tensor scales, int c_dim, bool bf16) -> Tensor")
def _(values, scales, c_dim, bf16) -> Tensor:
    return values.new_empty(values.shape, dtype=torch.bfloat16 if bf16 else torch.float32)
