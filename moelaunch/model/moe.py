"""Mixture of experts: routed experts chosen by the gate plus always-on shared experts. One forward for
training and inference, in one process or expert-parallel: the dispatcher moves the routed rows."""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn

from moelaunch import kernels
from moelaunch.model.config import ModelArgs
from moelaunch.model.expert_dispatch import ExpertDispatch, LocalDispatch
from moelaunch.model.expert_stack import ExpertStack
from moelaunch.model.gate import Gate
from moelaunch.model.mlp import MLP
from moelaunch.model.sharding import WHOLE, ModelShard

# Rows per expert up to which the stacked experts run together (the CPU grouped-linear kernel, or one
# zero-padded batched GEMM) instead of a GEMM per expert: decode-sized groups, where per-call overhead
# outweighs the padding's wasted arithmetic.
STACKED_MAX_ROWS = 64


class MoE(nn.Module):
    """Routed experts live in a dict keyed by global expert id (the checkpoint's `experts.J`), so an
    expert-parallel rank can hold just the ids its dispatcher owns under the same names."""

    def __init__(
        self, args: ModelArgs, dispatch: ExpertDispatch | None = None, shard: ModelShard = WHOLE
    ) -> None:
        super().__init__()
        self.dispatch = dispatch or LocalDispatch(args.n_routed_experts)
        self.n_routed_experts = args.n_routed_experts
        self.gate = Gate(args)
        self.local_ids = self.dispatch.expert_ids
        self.experts = nn.ModuleDict(
            {str(j): MLP(args.hidden_size, args.moe_intermediate_size) for j in self.local_ids}
        )
        # Set by stack_experts(): every local expert's [gate; up] and down projections, one stack each.
        self.gate_up: ExpertStack | None = None
        self.down: ExpertStack | None = None
        self.shared_experts = (
            MLP(args.hidden_size, args.n_shared_experts * args.moe_intermediate_size, shard)
            if args.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        mine = self.dispatch.rows(x)
        weights, ids = self.gate(mine)
        return self.dispatch(mine, weights, ids, self.run_grouped, shared, x.shape[0]).view(shape)

    def stack_experts(self) -> None:
        """Stack the local experts' weights for inference on small batches (see run_grouped).

        Each expert's tensors become views of the stacks, so nothing is held twice and the experts still
        work one by one. Plain float and integer weights stack; block-FP8 experts keep their kernels.
        """
        mlps = [self.experts[str(j)] for j in self.local_ids]
        if not mlps:
            return
        gate_up = ExpertStack.of([[m.gate_proj, m.up_proj] for m in mlps])
        down = ExpertStack.of([[m.down_proj] for m in mlps]) if gate_up is not None else None
        if down is not None:
            self.gate_up, self.down = gate_up, down

    def run_grouped(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Apply expert j to the j-th run of rows of x_sorted (rows grouped by expert, counts[j] each).

        `counts` is indexed by global expert id; experts not held here must have count 0.
        """
        local_counts = [counts[j] for j in self.local_ids]
        stack = self.gate_up
        largest = max(local_counts)
        if stack is not None and stack.quant is not None:
            # Integer experts: the kernels read them as stored; the torch path dequantizes them per call.
            if kernels.int_linear_on_cpu(x_sorted):
                return self.run_grouped_kernel(x_sorted, local_counts)
        elif stack is not None:
            if kernels.uses_grouped_linear_kernel(x_sorted, largest, stack.weight, STACKED_MAX_ROWS):
                return self.run_grouped_kernel(x_sorted, local_counts)
            busy = sum(n > 0 for n in local_counts)
            # Stacked only when most experts have rows: the batched GEMM reads every expert's weights.
            if 2 * busy >= len(local_counts) and largest <= STACKED_MAX_ROWS:
                return self.run_stacked(x_sorted, local_counts)
        out = torch.empty_like(x_sorted)
        start = 0
        for j, n in enumerate(counts):
            if n:
                out[start : start + n] = self.experts[str(j)](x_sorted[start : start + n])
                start += n
        return out

    def run_grouped_kernel(self, x_sorted: torch.Tensor, local_counts: list[int]) -> torch.Tensor:
        """run_grouped through the CPU grouped-linear kernel: no padding, idle experts' weights unread."""
        offsets = torch.tensor(list(accumulate(local_counts, initial=0)))
        gate, up = self.gate_up.grouped(x_sorted, offsets).chunk(2, dim=-1)
        return self.down.grouped(kernels.silu_mul(gate, up), offsets)

    def run_stacked(self, x_sorted: torch.Tensor, local_counts: list[int]) -> torch.Tensor:
        """run_grouped as two batched GEMMs: each local expert's rows zero-padded to the largest group."""
        n_local, width = len(local_counts), max(local_counts)
        counts = torch.tensor(local_counts, device=x_sorted.device)
        # Row i of expert e's group goes to padded slot e * width + i.
        group = torch.arange(n_local, device=x_sorted.device).repeat_interleave(counts)
        first_row = counts.cumsum(0) - counts
        slot = group * width + torch.arange(x_sorted.shape[0], device=x_sorted.device) - first_row[group]
        padded = x_sorted.new_zeros(n_local * width, x_sorted.shape[1])
        padded[slot] = x_sorted
        gate_up_w, down_w = self.gate_up.weight, self.down.weight
        # In the weights' dtype (bf16 weights under fp32 activations on the CPU: a bf16 batched GEMM).
        padded = padded.to(gate_up_w.dtype).view(n_local, width, -1)
        gate_up = torch.bmm(padded, gate_up_w.transpose(1, 2)).flatten(0, 1)
        act = kernels.silu_mul(*gate_up.chunk(2, dim=-1)).view(n_local, width, -1)
        return torch.bmm(act, down_w.transpose(1, 2)).view(n_local * width, -1)[slot].to(x_sorted.dtype)
