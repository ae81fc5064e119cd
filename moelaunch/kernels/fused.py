"""The small per-token steps around the big products (RMSNorm, rotary embedding, SiLU gating, the
routed experts' weighted sum, the MoE router with or without its GEMM): csrc/fused_cpu.cpp and
csrc/moe_route_cpu.cpp where `selection` says so (fp32 CPU tensors outside
autograd), the torch references in `fused_reference` everywhere else.

`mla_latent` and `rotate_tail` may work in place on their input and return it: callers must use the
returned tensor and not the input's old values.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from moelaunch.kernels import fused_reference as ref
from moelaunch.kernels import selection
from moelaunch.kernels.cpu_ops import cpu_kernel


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over x's last dimension."""
    if selection.rms_norm_on_cpu(x, weight):
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        return cpu_kernel("rms_norm_cpu")(rows, weight.contiguous(), eps).view(x.shape)
    return ref.rms_norm_ref(x, weight, eps)


def mla_latent(
    latent: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor, interleaved: bool
) -> Tensor:
    """latent [T, C + P] -> [rms_norm(first C columns) | last P columns rotated by tables [T, P/2]]."""
    if selection.mla_latent_on_cpu(latent, weight, cos, sin):
        cpu_kernel("mla_latent_cpu")(
            latent, weight.contiguous(), eps, cos.contiguous(), sin.contiguous(), interleaved
        )
        return latent
    return ref.mla_latent_ref(latent, weight, eps, cos, sin, interleaved)


def mla_input_norms(
    q_a: Tensor,
    q_weight: Tensor,
    q_eps: float,
    latent: Tensor,
    weight: Tensor,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(q_a), mla_latent(latent, ...)): the MLA's two input norms, one kernel call on the CPU.
    latent may be worked on in place, as in mla_latent."""
    if selection.mla_input_norms_on_cpu(q_a, q_weight, latent, weight, cos, sin):
        q = cpu_kernel("mla_input_norms_cpu")(
            q_a, q_weight.contiguous(), q_eps, latent, weight.contiguous(), eps, cos.contiguous(),
            sin.contiguous(), interleaved,
        )  # fmt: skip
        return q, latent
    return rms_norm(q_a, q_weight, q_eps), mla_latent(latent, weight, eps, cos, sin, interleaved)


def rotate_tail(x: Tensor, cos: Tensor, sin: Tensor, p: int, interleaved: bool) -> Tensor:
    """x [T, H, D] with the last p columns of every head rotated by tables [T, p/2]."""
    if selection.rotate_tail_on_cpu(x, cos, sin):
        cpu_kernel("rotate_tail_cpu")(x, cos.contiguous(), sin.contiguous(), p, interleaved)
        return x
    return ref.rotate_tail_ref(x, cos, sin, p, interleaved)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for [T, I] inputs."""
    if selection.silu_mul_on_cpu(gate, up):
        return cpu_kernel("silu_mul_cpu")(gate, up)
    return ref.silu_mul_ref(gate, up)


def moe_combine(
    y: Tensor, slot: Tensor, weights: Tensor, base: Tensor | None = None, residual: Tensor | None = None
) -> Tensor:
    """residual + base + sum_k weights[:, k] * y[slot[:, k]]: y [S, D] expert outputs, slot/weights [T, K]
    (residual: the block's input, so its residual add is no op of its own)."""
    if selection.moe_combine_on_cpu(y, weights, base, residual):
        return cpu_kernel("moe_combine_cpu")(
            y.contiguous(), slot.long().contiguous(), weights.contiguous(), base, residual
        )
    return ref.moe_combine_ref(y, slot, weights, base, residual)


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + y, RMSNorm(x + y)) over the last dimension: a residual add and the next pre-norm."""
    if selection.add_rms_norm_on_cpu(x, y, weight):
        total, normed = cpu_kernel("add_rms_norm_cpu")(x, y, weight.contiguous(), eps)
        return total, normed
    total = x + y
    return total, ref.rms_norm_ref(total, weight, eps)


def moe_route(
    logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    n_groups: int,
    topk_groups: int,
    sigmoid: bool,
    normalize: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k]); see moe_route_ref."""
    args = (top_k, n_groups, topk_groups, sigmoid, normalize, scale)
    if selection.moe_route_on_cpu(logits, bias):
        weights, ids = cpu_kernel("moe_route_cpu")(logits.contiguous(), bias, *args)
        return weights, ids
    return ref.moe_route_ref(logits, bias, *args)


def moe_gate(
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
    """The router: logits = x [T, D] @ weight [E, D]^T in fp32, then moe_route; one kernel call on the CPU
    (its GEMM the grouped-linear kernel's)."""
    args = (top_k, n_groups, topk_groups, sigmoid, normalize, scale)
    if selection.moe_gate_on_cpu(x, weight, bias):
        weights, ids = cpu_kernel("moe_gate_cpu")(x, weight, bias, *args)
        return weights, ids
    return moe_route(F.linear(x.float(), weight.float()), bias, *args)


def moe_sort_rows(x: Tensor, ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rows of x [T, D] per (token, expert) pair of ids [T, K], sorted by expert; see moe_sort_rows_ref."""
    if selection.moe_sort_rows_on_cpu(x, ids):
        return cpu_kernel("moe_sort_rows_cpu")(x, ids, n_experts)
    return ref.moe_sort_rows_ref(x, ids, n_experts)
