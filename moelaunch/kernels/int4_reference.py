"""Plain-torch references for INT4 group-wise weights: asymmetric quantization with zero points, two
values per byte, and the weight-only linear that unpacks and dequantizes them.

Layout, for w [N, K] (K even) and groups of G consecutive input columns per output row (the last group may
be partial):
- packed uint8 [N, K/2]: byte j of a row holds column 2j in its low nibble and column 2j+1 in its high one;
- scale fp32 [N, ceil(K/G)]: (max - min) / 15 over the group, its range widened to include 0;
- zero uint8 [N, ceil(K/G)]: the integer code of 0.0, in [0, 15];
- W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G], within scale / 2 of the original.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT4_MAX = 15.0
INT4_GROUP_SIZE = 128
# Floor on a group's range so an all-zero group (a pruned block) gets a finite, non-zero scale.
INT4_RANGE_FLOOR = 1e-8


def _grouped(w: Tensor, group_size: int) -> Tensor:
    """w [N, K] as [N, ceil(K/G), G] fp32, the last group zero-padded (zeros are inside every group's range,
    so padding changes no scale or zero point)."""
    n, k = w.shape
    groups = -(-k // group_size)
    padded = w.float().new_zeros(n, groups * group_size)
    padded[:, :k] = w.float()
    return padded.view(n, groups, group_size)


def int4_weight_quant_ref(w: Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[Tensor, Tensor, Tensor]:
    """w [N, K] -> (packed uint8 [N, K/2], fp32 scale [N, ceil(K/G)], uint8 zero [N, ceil(K/G)])."""
    n, k = w.shape
    if k % 2:
        raise ValueError(f"int4 packs two columns per byte: the input width K={k} must be even")
    if group_size < 16 or group_size % 16:
        raise ValueError(f"int4 group size {group_size} must be a multiple of 16 (the GPU kernel's K tile)")
    g = _grouped(w, group_size)
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)
    scale = (hi - lo).clamp_min(INT4_RANGE_FLOOR) / INT4_MAX
    zero = torch.round(-lo / scale).clamp_(0, INT4_MAX)
    q = (torch.round(g / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp_(0, INT4_MAX)
    q = q.flatten(1)[:, :k].to(torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale, zero.to(torch.uint8)


def int4_unpack_ref(packed: Tensor) -> Tensor:
    """packed uint8 [N, K/2] -> codes uint8 [N, K] in 0..15."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def int4_dequant_ref(
    packed: Tensor, scale: Tensor, zero: Tensor, group_size: int, out_dtype: torch.dtype | None = None
) -> Tensor:
    """W [N, K] = (q - zero) * scale, per group of G input columns."""
    q = int4_unpack_ref(packed).float()
    k = q.shape[-1]
    s = scale.float().repeat_interleave(group_size, dim=-1)[:, :k]
    z = zero.float().repeat_interleave(group_size, dim=-1)[:, :k]
    return ((q - z) * s).to(out_dtype or torch.get_default_dtype())


def int4_linear_ref(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_size: int) -> Tensor:
    """Weight-only: y = x @ dequant(W).T in fp32, output in x's dtype."""
    w = int4_dequant_ref(packed, scale, zero, group_size, torch.float32)
    return torch.matmul(x.float(), w.T).to(x.dtype)
