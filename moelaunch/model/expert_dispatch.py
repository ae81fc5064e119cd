"""How an MoE layer gets its tokens to the routed experts and their outputs back.

The MoE holds one dispatcher: LocalDispatch here when every expert is in this process; an
expert-parallel one (parallel/expert_parallel.py) when experts are spread over ranks. Both sort the
(token, expert) pairs by expert, hand the runs to the layer's `run` (which applies each local expert
to its run of rows) and combine the outputs per token with the routing weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from moelaunch import kernels

# (rows grouped by expert, rows per expert indexed by global expert id) -> expert outputs, same rows.
RunExperts = Callable[[torch.Tensor, list[int]], torch.Tensor]


class ExpertDispatch(Protocol):
    expert_ids: list[int]  # the routed experts held in this process, by global id

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of the layer's input [N, dim] that this process routes."""
        ...

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        run: RunExperts,
        base: torch.Tensor | None,
        n_rows: int,
    ) -> torch.Tensor:
        """base + sum_k weights[:, k] * expert_{ids[:, k]}(x) for every one of the layer's n_rows rows,
        given x = rows(input) and its routing (weights, ids)."""
        ...


def combine_expert_outputs(
    y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, base: torch.Tensor | None = None
) -> torch.Tensor:
    """base + per token the routing-weighted sum of its expert outputs: y's row i is the output for
    (token, k) pair order[i] of weights [T, K] (pairs numbered token * K + k)."""
    slot = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return kernels.moe_combine(y, slot.view(weights.shape), weights, base)


class LocalDispatch:
    """Every expert is in this process: sort, run, combine."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.expert_ids = list(range(n_experts))

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        run: RunExperts,
        base: torch.Tensor | None,
        n_rows: int,
    ) -> torch.Tensor:
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.n_experts).tolist()
        token_of_slot = order // ids.shape[1]
        # index_select, not x[token_of_slot]: the same gather, several times faster on the CPU.
        y = run(x.index_select(0, token_of_slot), counts)
        return combine_expert_outputs(y, order, weights, base)
