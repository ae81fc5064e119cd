"""RMSNorm computed in fp32, as DeepSeek and transformers both do (kernels.rms_norm)."""

from __future__ import annotations

import torch
from torch import nn

from moelaunch import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, this norm of x + y): a residual add and the next pre-norm, in one kernel on the CPU."""
        return kernels.add_rms_norm(x, y, self.weight, self.eps)
