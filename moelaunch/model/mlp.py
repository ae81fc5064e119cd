"""The SwiGLU feed-forward used by dense layers, routed experts and shared experts."""

from __future__ import annotations

import torch
from torch import nn

from moelaunch import kernels
from moelaunch.model.expert_stack import ExpertStack
from moelaunch.model.sharding import WHOLE, ModelShard


class MLP(nn.Module):
    """down_proj(silu(gate_proj x) * up_proj x); HF names, which are the checkpoint's names. Under
    tensor parallelism the hidden width is split (gate and up by column, down by row)."""

    def __init__(self, dim: int, inter_dim: int, shard: ModelShard = WHOLE) -> None:
        super().__init__()
        self.gate_proj = shard.column(dim, inter_dim)
        self.up_proj = shard.column(dim, inter_dim)
        self.down_proj = shard.row(inter_dim, dim)
        # Set by stack_gate_up(), [gate; up] as one product: a float weight, or integer weights' stack.
        self.gate_up: torch.Tensor | None = None
        self.int_gate_up: ExpertStack | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The SiLU gating in the product's epilogue (bf16 after a bf16 GEMM).
        if self.gate_up is not None:
            return self.down_proj(kernels.linear(x, self.gate_up, gated=True)).to(x.dtype)
        if self.int_gate_up is not None:
            return self.down_proj(self.int_gate_up.linear(x, gated=True))
        return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))

    @torch.no_grad()
    def stack_gate_up(self) -> None:
        """For inference: gate and up as one weight (one product per call instead of two); the two
        projections' tensors become views of it. Plain float or integer weights (block-FP8 keeps its
        own)."""
        gate, up = self.gate_proj, self.up_proj
        if gate.quant is not None:
            self.int_gate_up = ExpertStack.of([[gate, up]])
            return
        if any(lin.weight.element_size() < 2 for lin in (gate, up)):
            return
        self.gate_up = torch.cat([gate.weight, up.weight])
        inter = gate.out_features
        gate.weight = nn.Parameter(self.gate_up[:inter], requires_grad=False)
        up.weight = nn.Parameter(self.gate_up[inter:], requires_grad=False)
