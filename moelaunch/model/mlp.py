"""The SwiGLU feed-forward used by dense layers, routed experts and shared experts."""

from __future__ import annotations

import torch
from torch import nn

from moelaunch import kernels
from moelaunch.model.sharding import WHOLE, ModelShard


class MLP(nn.Module):
    """down_proj(silu(gate_proj x) * up_proj x); HF names, which are the checkpoint's names. Under
    tensor parallelism the hidden width is split (gate and up by column, down by row)."""

    def __init__(self, dim: int, inter_dim: int, shard: ModelShard = WHOLE) -> None:
        super().__init__()
        self.gate_proj = shard.column(dim, inter_dim)
        self.up_proj = shard.column(dim, inter_dim)
        self.down_proj = shard.row(inter_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))
