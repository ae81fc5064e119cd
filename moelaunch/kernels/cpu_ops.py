"""The C++ CPU kernels (csrc/) as torch custom ops, `torch.ops.moelaunch.<name>`, each with a fake
implementation that gives its output's shape and dtype, so torch.compile traces through them as one op
each and a dispatch mode sees each call as one op.

Eager calls outside any trace go to the extension's function directly (`cpu_kernel`): a registered
op's Python dispatch costs ~14 us a call, which small-model decode steps feel at ~60 calls per step.

A new kernel follows the same pattern: bind it in csrc/bindings.cpp, define it here with
`torch.library.custom_op("moelaunch::<name>", mutates_args=(...))` calling `_ext().<name>`, give it a
`register_fake` (output shapes from input shapes only), and call it through `cpu_kernel("<name>")`.
A kernel that writes into an input declares it in mutates_args and returns nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

from moelaunch.kernels import cpu_extension


def _ext() -> ModuleType:
    return cpu_extension.require()


def traced() -> bool:
    """Whether kernel calls must go through the registered ops: torch.compile is tracing, or a
    TorchDispatchMode (fake tensors, an op counter, the sync guard) is watching."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def cpu_kernel(name: str) -> Callable:
    """The C++ kernel `name`: its registered op while traced, else the extension's function."""
    if traced():
        return getattr(torch.ops.moelaunch, name)
    return getattr(_ext(), name)


@torch.library.custom_op("moelaunch::grouped_linear_cpu", mutates_args=())
def grouped_linear_cpu(
    x: Tensor, weight: Tensor, offsets: Tensor, gated: bool = False, path: int = -1
) -> Tensor:
    return _ext().grouped_linear_cpu(x, weight, offsets, gated, path)


@grouped_linear_cpu.register_fake
def _(x: Tensor, weight: Tensor, offsets: Tensor, gated: bool = False, path: int = -1) -> Tensor:
    # fp32 whatever x's dtype (fp32 or bf16): the sums are fp32, the caller rounds them.
    return x.new_empty(x.shape[0], weight.shape[1] // (2 if gated else 1), dtype=torch.float32)


@torch.library.custom_op("moelaunch::per_head_linear_cpu", mutates_args=())
def per_head_linear_cpu(x: Tensor, stack: Tensor, path: int = -1) -> Tensor:
    return _ext().per_head_linear_cpu(x, stack, path)


@per_head_linear_cpu.register_fake
def _(x: Tensor, stack: Tensor, path: int = -1) -> Tensor:
    return x.new_empty(x.shape[0], x.shape[1], stack.shape[1], dtype=torch.float32)


@torch.library.custom_op("moelaunch::paged_mla_decode_cpu", mutates_args=())
def paged_mla_decode_cpu(
    q_latent: Tensor,
    q_pe: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    starts: Tensor | None,
    path: int = -1,
) -> Tensor:
    return _ext().paged_mla_decode_cpu(q_latent, q_pe, cache, block_table, seq_lens, scale, starts, path)


@paged_mla_decode_cpu.register_fake
def _(q_latent, q_pe, cache, block_table, seq_lens, scale, starts, path=-1) -> Tensor:
    # fp32 whatever the queries' dtype (fp32 or bf16): the caller rounds it.
    return q_latent.new_empty(q_latent.shape, dtype=torch.float32)


@torch.library.custom_op("moelaunch::paged_mla_decode_fp8_cpu", mutates_args=())
def paged_mla_decode_fp8_cpu(
    q_latent: Tensor,
    q_pe: Tensor,
    cache: Tensor,
    cache_scales: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    starts: Tensor | None,
) -> Tensor:
    return _ext().paged_mla_decode_fp8_cpu(
        q_latent, q_pe, cache, cache_scales, block_table, seq_lens, scale, starts
    )


@paged_mla_decode_fp8_cpu.register_fake
def _(q_latent, q_pe, cache, cache_scales, block_table, seq_lens, scale, starts) -> Tensor:
    return q_latent.new_empty(q_latent.shape, dtype=torch.float32)


@torch.library.custom_op("moelaunch::rms_norm_cpu", mutates_args=())
def rms_norm_cpu(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _ext().rms_norm_cpu(x, weight, eps)


@rms_norm_cpu.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("moelaunch::mla_latent_cpu", mutates_args=("latent",))
def mla_latent_cpu(
    latent: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor, interleaved: bool
) -> None:
    _ext().mla_latent_cpu(latent, weight, eps, cos, sin, interleaved)


@mla_latent_cpu.register_fake
def _(latent, weight, eps, cos, sin, interleaved) -> None:
    return None


@torch.library.custom_op("moelaunch::mla_input_norms_cpu", mutates_args=("latent",))
def mla_input_norms_cpu(
    q_a: Tensor,
    q_weight: Tensor,
    q_eps: float,
    latent: Tensor,
    weight: Tensor,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
) -> Tensor:
    return _ext().mla_input_norms_cpu(q_a, q_weight, q_eps, latent, weight, eps, cos, sin, interleaved)


@mla_input_norms_cpu.register_fake
def _(q_a, q_weight, q_eps, latent, weight, eps, cos, sin, interleaved) -> Tensor:
    return q_a.new_empty(q_a.shape)


@torch.library.custom_op("moelaunch::rotate_tail_cpu", mutates_args=("x",))
def rotate_tail_cpu(x: Tensor, cos: Tensor, sin: Tensor, p: int, interleaved: bool) -> None:
    _ext().rotate_tail_cpu(x, cos, sin, p, interleaved)


@rotate_tail_cpu.register_fake
def _(x, cos, sin, p, interleaved) -> None:
    return None


@torch.library.custom_op("moelaunch::silu_mul_cpu", mutates_args=())
def silu_mul_cpu(gate: Tensor, up: Tensor) -> Tensor:
    return _ext().silu_mul_cpu(gate, up)


@silu_mul_cpu.register_fake
def _(gate: Tensor, up: Tensor) -> Tensor:
    return gate.new_empty(gate.shape[0], gate.shape[1])


@torch.library.custom_op("moelaunch::moe_combine_cpu", mutates_args=())
def moe_combine_cpu(
    y: Tensor, slot: Tensor, weights: Tensor, base: Tensor | None, residual: Tensor | None
) -> Tensor:
    return _ext().moe_combine_cpu(y, slot, weights, base, residual)


@moe_combine_cpu.register_fake
def _(y: Tensor, slot: Tensor, weights: Tensor, base: Tensor | None, residual: Tensor | None) -> Tensor:
    return y.new_empty(slot.shape[0], y.shape[1])


@torch.library.custom_op("moelaunch::add_rms_norm_cpu", mutates_args=())
def add_rms_norm_cpu(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    total, normed = _ext().add_rms_norm_cpu(x, y, weight, eps)
    return total, normed


@add_rms_norm_cpu.register_fake
def _(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("moelaunch::moe_route_cpu", mutates_args=())
def moe_route_cpu(
    logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    n_groups: int,
    topk_groups: int,
    sigmoid: bool,
    normalize: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    weights, ids = _ext().moe_route_cpu(logits, bias, top_k, n_groups, topk_groups, sigmoid, normalize, scale)
    return weights, ids


@moe_route_cpu.register_fake
def _(logits, bias, top_k, n_groups, topk_groups, sigmoid, normalize, scale) -> tuple[Tensor, Tensor]:
    rows = logits.shape[0]
    return logits.new_empty(rows, top_k), logits.new_empty(rows, top_k, dtype=torch.long)


@torch.library.custom_op("moelaunch::moe_gate_cpu", mutates_args=())
def moe_gate_cpu(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    top_k: int,
    n_groups: int,
    topk_groups: int,
    sigmoid: bool,
    normalize: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    routing = (top_k, n_groups, topk_groups, sigmoid, normalize, scale)
    weights, ids = _ext().moe_gate_cpu(x, weight, bias, *routing)
    return weights, ids


@moe_gate_cpu.register_fake
def _(x, weight, bias, top_k, n_groups, topk_groups, sigmoid, normalize, scale) -> tuple[Tensor, Tensor]:
    rows = x.shape[0]
    return x.new_empty(rows, top_k), x.new_empty(rows, top_k, dtype=torch.long)


@torch.library.custom_op("moelaunch::moe_sort_rows_cpu", mutates_args=())
def moe_sort_rows_cpu(x: Tensor, ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rows, sorted_ids, offsets, slot = _ext().moe_sort_rows_cpu(x, ids, n_experts)
    return rows, sorted_ids, offsets, slot


@moe_sort_rows_cpu.register_fake
def _(x: Tensor, ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    pairs = ids.numel()
    return (x.new_empty(pairs, x.shape[1]), ids.new_empty(pairs), ids.new_empty(n_experts + 1),
            ids.new_empty(ids.shape))  # fmt: skip


@torch.library.custom_op("moelaunch::int8_linear_cpu", mutates_args=())
def int8_linear_cpu(x: Tensor, q: Tensor, scale: Tensor, offsets: Tensor, path: int) -> Tensor:
    return _ext().int8_linear_cpu(x, q, scale, offsets, path)


@int8_linear_cpu.register_fake
def _(x: Tensor, q: Tensor, scale: Tensor, offsets: Tensor, path: int) -> Tensor:
    return x.new_empty(x.shape[0], q.shape[1], dtype=torch.float32)


@torch.library.custom_op("moelaunch::w8a8_linear_cpu", mutates_args=())
def w8a8_linear_cpu(
    x: Tensor, q: Tensor, scale: Tensor, offsets: Tensor, path: int, row_amax: Tensor | None
) -> Tensor:
    return _ext().w8a8_linear_cpu(x, q, scale, offsets, path, row_amax)


@w8a8_linear_cpu.register_fake
def _(x: Tensor, q: Tensor, scale: Tensor, offsets: Tensor, path: int, row_amax: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], q.shape[1], dtype=torch.float32)


@torch.library.custom_op("moelaunch::int4_linear_cpu", mutates_args=())
def int4_linear_cpu(
    x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, offsets: Tensor, group_size: int, path: int
) -> Tensor:
    return _ext().int4_linear_cpu(x, packed, scale, zero, offsets, group_size, path)


@int4_linear_cpu.register_fake
def _(x, packed, scale, zero, offsets, group_size, path) -> Tensor:
    return x.new_empty(x.shape[0], packed.shape[1], dtype=torch.float32)


@torch.library.custom_op("moelaunch::argmax_rows_cpu", mutates_args=())
def argmax_rows_cpu(logits: Tensor) -> tuple[Tensor, Tensor]:
    index, finite = _ext().argmax_rows_cpu(logits)
    return index, finite


@argmax_rows_cpu.register_fake
def _(logits: Tensor) -> tuple[Tensor, Tensor]:
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.bool)
