"""Torch definitions of the small per-token steps that csrc/fused_cpu.cpp and csrc/moe_route_cpu.cpp
fuse (RMSNorm, rotary embedding, SiLU gating, the routed experts' weighted sum, the MoE router after its
GEMM): the path everywhere the C++ kernels do not run (CUDA, other dtypes, autograd), and what they are
tested against."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in fp32 (as DeepSeek and transformers compute it), returned in x's dtype."""
    if x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_ref(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """x [T, d] or [T, H, d] rotated by tables [T, d/2], in fp32: pairs (2i, 2i+1) when interleaved
    (DeepSeek's checkpoint layout), else (i, i + d/2)."""
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    dtype = x.dtype
    x = x if dtype == torch.float32 else x.float()  # no no-op casts: this runs twice per layer
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if dtype == torch.float32 else out.to(dtype)


def mla_latent_ref(
    latent: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor, interleaved: bool
) -> Tensor:
    """latent [T, C + P] -> [rms_norm(first C columns) | rotated last P columns]."""
    kv, pe = latent.split([weight.numel(), latent.shape[-1] - weight.numel()], dim=-1)
    return torch.cat([rms_norm_ref(kv, weight, eps), rotate_ref(pe, cos, sin, interleaved)], dim=-1)


def rotate_tail_ref(x: Tensor, cos: Tensor, sin: Tensor, p: int, interleaved: bool) -> Tensor:
    """x [T, H, D] with the last p columns of every head rotated."""
    head, tail = x.split([x.shape[-1] - p, p], dim=-1)
    return torch.cat([head, rotate_ref(tail, cos, sin, interleaved)], dim=-1)


def silu_mul_ref(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def moe_combine_ref(
    y: Tensor, slot: Tensor, weights: Tensor, base: Tensor | None, residual: Tensor | None = None
) -> Tensor:
    """residual + base + sum_k weights[:, k] * y[slot[:, k]]: y [S, D], slot/weights [T, K], base and
    residual [T, D] or None."""
    out = torch.einsum("tk,tkd->td", weights.to(y.dtype), y[slot])
    out = out if base is None else base + out
    return out if residual is None else residual + out


def moe_route_ref(
    logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    n_groups: int,
    topk_groups: int,
    sigmoid: bool,
    normalize: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] (fp32) -> (weights [T, top_k] fp32, expert ids [T, top_k]).

    Experts are chosen by score plus `bias` (DeepSeek-V3's noaux_tc), within the `topk_groups` best of
    `n_groups` groups (ranked by their best score, or with a bias by the sum of their best two); the
    weights are the unbiased scores, normalized to sum 1 when asked, times `scale`.
    """
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias
    if n_groups > 1:
        grouped = choice.view(-1, n_groups, choice.shape[-1] // n_groups)
        group_scores = grouped.amax(dim=-1) if bias is None else grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(topk_groups, dim=-1).indices
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        choice = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def moe_sort_rows_ref(x: Tensor, ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The (token, expert) pairs of ids [T, K] (pair i = token * K + k) sorted stably by expert, with their
    token rows of x [T, D]: (rows [T*K, D], sorted pairs' experts [T*K], offsets [E + 1]: expert e's rows
    are offsets[e]:offsets[e + 1], slot [T, K]: the row each pair went to)."""
    sorted_ids, order = ids.flatten().sort(stable=True)
    offsets = torch.searchsorted(sorted_ids, expert_bounds(n_experts, ids.device))
    slot = torch.empty_like(order).scatter_(0, order, pair_numbers(order.numel(), ids.device))
    return x.index_select(0, order // ids.shape[1]), sorted_ids, offsets, slot.view(ids.shape)


@functools.cache
def _arange(n: int, device: torch.device) -> Tensor:
    """0..n-1 (int64), made once per size and device, not in every layer of every step; never written."""
    return torch.arange(n, device=device)


# Each a constant of a compiled graph (not rebuilt per call). torch.compile names such a constant after
# its function, so each function takes one size per graph: one for the expert bounds, one for the pairs.
@torch.compiler.assume_constant_result
def expert_bounds(n_experts: int, device: torch.device) -> Tensor:
    return _arange(n_experts + 1, device)


@torch.compiler.assume_constant_result
def pair_numbers(n_pairs: int, device: torch.device) -> Tensor:
    return _arange(n_pairs, device)
