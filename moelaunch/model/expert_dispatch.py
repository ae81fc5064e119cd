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
from moelaunch.kernels.fused_reference import pair_numbers

# (rows grouped by expert, rows per expert indexed by global expert id) -> expert outputs, same rows.
RunExperts = Callable[[torch.Tensor, list[int]], torch.Tensor]
# The same with the grouping on the device: (rows sorted by local expert, each row's local expert,
# offsets [n_local + 1] where each local expert's rows start, the most rows one expert can get).
RunByOffsets = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


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

    # Whether route_on_device serves this dispatcher (every rank of it sees the same rows).
    routes_on_device: bool

    def route_on_device(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        run: RunByOffsets,
        base: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The same result (plus residual, when given) for the layer's whole input x with counts and
        offsets kept on the device: fixed shapes, no host sync (the static decode step)."""
        ...


def combine_expert_outputs(
    y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, base: torch.Tensor | None = None
) -> torch.Tensor:
    """base + per token the routing-weighted sum of its expert outputs: y's row i is the output for
    (token, k) pair order[i] of weights [T, K] (pairs numbered token * K + k)."""
    slot = torch.empty_like(order).scatter_(0, order, pair_numbers(order.numel(), order.device))
    return kernels.moe_combine(y, slot.view(weights.shape), weights, base)


class LocalDispatch:
    """Every expert is in this process: sort, run, combine."""

    routes_on_device = True

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

    def route_on_device(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        run: RunByOffsets,
        base: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, sorted_ids, offsets, slot = kernels.moe_sort_rows(x, ids, self.n_experts)
        # A token takes an expert at most once: no expert gets more rows than there are tokens.
        y = run(rows, sorted_ids, offsets, x.shape[0])
        return kernels.moe_combine(y, slot, weights, base, residual)
