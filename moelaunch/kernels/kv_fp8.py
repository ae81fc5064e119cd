"""FP8 (e4m3) storage for the MLA latent cache: per token, the c_kv part and the k_pe part each get one
fp32 scale, computed when the token is stored.

Two scales because the parts differ in range: c_kv comes out of an RMSNorm (values near its weight), while
k_pe is a rotated projection that can be an order of magnitude larger or smaller; one shared scale would
leave the smaller part in few mantissa steps or in subnormals. A token row of 576 values then costs 576
bytes + 8 bytes of scales instead of 1152 in bf16.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_KV_DTYPE = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(FP8_KV_DTYPE).max  # 448
SCALES_PER_TOKEN = 2  # c_kv, k_pe


def quantize_latent(latent: Tensor, c_dim: int) -> tuple[Tensor, Tensor]:
    """latent [..., C + P] -> (values [..., C + P] float8_e4m3fn, scales [..., 2] fp32) with
    latent ~= values * scale of its part. Each part's largest magnitude maps to 448."""
    x = latent.float()
    parts = x.split([c_dim, x.shape[-1] - c_dim], dim=-1)
    # A part of zeros gets scale 1 (any positive scale reads back as zeros) instead of a 0/0.
    scales = torch.stack([p.abs().amax(dim=-1) / E4M3_MAX for p in parts], dim=-1)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.cat([p / scales[..., i : i + 1] for i, p in enumerate(parts)], dim=-1)
    return values.to(FP8_KV_DTYPE), scales


def dequantize_latent(
    values: Tensor, scales: Tensor, c_dim: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The inverse of `quantize_latent`: [..., C + P] in dtype (the product is taken in fp32)."""
    c, pe = values.float().split([c_dim, values.shape[-1] - c_dim], dim=-1)
    return torch.cat([c * scales[..., :1], pe * scales[..., 1:]], dim=-1).to(dtype)
