"""Rotary position embedding with YaRN frequency interpolation: the cos/sin tables (the rotation itself
is `kernels.rotate_tail` / `kernels.mla_latent`).

HF DeepSeek checkpoints store q/k rope dims as interleaved pairs (x[2i], x[2i+1]); both q and k are
rotated as stored here, so scores equal transformers' (it de-interleaves both, a permutation the dot
product does not see).
"""

from __future__ import annotations

import math

import torch

from moelaunch.model.config import ModelArgs, yarn_mscale


def _correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(args: ModelArgs) -> torch.Tensor:
    """On the CPU whatever the default device (the module's .to() moves them): a model built on the meta
    device would otherwise run these through torch's meta refs, which import torch._dynamo and sympy."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    rs = args.rope_scaling
    if not rs.enabled:
        return freqs
    low = max(math.floor(_correction_dim(rs.beta_fast, dim, base, rs.original_max_position_embeddings)), 0)
    high = min(
        math.ceil(_correction_dim(rs.beta_slow, dim, base, rs.original_max_position_embeddings)), dim - 1
    )
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    return freqs / rs.factor * ramp + freqs * (1 - ramp)


def rope_amplitude(args: ModelArgs) -> float:
    """Factor transformers applies to cos/sin under YaRN; 1.0 whenever mscale == mscale_all_dim."""
    rs = args.rope_scaling
    if not rs.enabled:
        return 1.0
    if rs.attention_factor is not None:
        return float(rs.attention_factor)
    if rs.mscale and rs.mscale_all_dim:
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)


class RotaryEmbedding(torch.nn.Module):
    """Holds inverse frequencies; `cos_sin(positions)` gives the [T, d/2] tables the kernels rotate by."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.amplitude = rope_amplitude(args)
        self.interleaved = args.rope_interleave
        self.register_buffer("inv_freq", inverse_frequencies(args), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[..., None] * self.inv_freq
        return angles.cos() * self.amplitude, angles.sin() * self.amplitude
