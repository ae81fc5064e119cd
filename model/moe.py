"""Mixture of experts: routed experts chosen by the gate plus always-on shared experts."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelArgs
from .gate import Gate
from .mlp import MLP


class MoE(nn.Module):
    """Routed experts live in a dict keyed by global expert id (the checkpoint's `experts.J`), so an
    expert-parallel rank can hold just the ids it owns under the same names."""

    def __init__(self, args: ModelArgs, expert_ids: list[int] | None = None) -> None:
        super().__init__()
        ids = range(args.n_routed_experts) if expert_ids is None else expert_ids
        self.n_routed_experts = args.n_routed_experts
        self.gate = Gate(args)
        self.experts = nn.ModuleDict({str(j): MLP(args.hidden_size, args.moe_intermediate_size) for j in ids})
        self.shared_experts = (
            MLP(args.hidden_size, args.n_shared_experts * args.moe_intermediate_size)
            if args.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        out = self.routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[:, k] * expert_{ids[:, k]}(x), every expert local."""
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        token_of_slot = order // ids.shape[1]
        counts = torch.bincount(flat_ids, minlength=self.n_routed_experts).tolist()
        y = self.run_grouped(x[token_of_slot], counts)
        y = y * weights.flatten()[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token_of_slot, y)

    def run_grouped(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Apply expert j to the j-th run of rows of x_sorted (rows grouped by expert, counts[j] each).

        `counts` is indexed by global expert id; experts not held here must have count 0.
        """
        out = torch.empty_like(x_sorted)
        start = 0
        for j, n in enumerate(counts):
            if n:
                out[start : start + n] = self.experts[str(j)](x_sorted[start : start + n])
                start += n
        return out
