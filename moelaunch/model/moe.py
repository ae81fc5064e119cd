"""Mixture of experts: routed experts chosen by the gate plus always-on shared experts. One forward for
training and inference, in one process or expert-parallel: the dispatcher moves the routed rows."""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from moelaunch import kernels
from moelaunch.model.config import ModelArgs
from moelaunch.model.expert_dispatch import ExpertDispatch, LocalDispatch
from moelaunch.model.expert_stack import ExpertStack
from moelaunch.model.gate import Gate
from moelaunch.model.mlp import MLP
from moelaunch.model.routed_counts import RoutedCounts
from moelaunch.model.sharding import WHOLE, ModelShard

# Rows per expert up to which the stacked experts run together (the CPU grouped-linear kernel, or one
# zero-padded batched GEMM) instead of a GEMM per expert: decode-sized groups, where per-call overhead
# outweighs the padding's wasted arithmetic.
STACKED_MAX_ROWS = 64
# The same for bf16 experts the AMX tiles multiply (the grouped kernel reads each expert's weight once per
# 16 rows, from cache after the first): against the per-expert oneDNN GEMMs a 512-token bf16 prompt step
# (~64 rows per expert) took 37 against 47 ms, a 2048-token one (~256) 120 against 126 ms.
TILES_MAX_ROWS = 512


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
        # Set by the engine when it records routed load: the counts, and this layer's id in them.
        self.counted: tuple[RoutedCounts, int] | None = None

    def forward(
        self,
        x: torch.Tensor,
        static: bool = False,
        valid: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """static: route on the device only (no host sync, shapes fixed by x's), as the static decode
        step needs; eager steps take that path too wherever it is the one they would take anyway.
        valid [rows] bool: the rows that are not padding (counted routed load leaves padding out).
        residual (x's shape): added to the output, inside the combine on the device path."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if residual is not None:
            residual = residual.reshape(x.shape)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if static or self._small_batch_on_device(x):
            weights, ids = self.gate(x)
            if self.counted is not None:  # every rank routed all rows: each counts its dispatch share
                self._count(self.dispatch.rows(ids), None if valid is None else self.dispatch.rows(valid))
            return self.run_on_device(x, weights, ids, shared, residual).view(shape)
        mine = self.dispatch.rows(x)
        weights, ids = self.gate(mine)
        if self.counted is not None:
            self._count(ids, None if valid is None else self.dispatch.rows(valid))
        if self._gathers_in_bf16(mine, ids):
            # The rows gathered in bf16 (half the bytes), the experts' outputs widened back for the combine.
            run = lambda rows, counts: self.run_grouped(rows, counts).to(mine.dtype)  # noqa: E731
            out = self.dispatch(mine.to(self.gate_up.weight.dtype), weights, ids, run, shared, x.shape[0])
        else:
            out = self.dispatch(mine, weights, ids, self.run_grouped, shared, x.shape[0])
        return (out if residual is None else residual + out).view(shape)

    def _gathers_in_bf16(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether x's rows may be rounded to the experts' bf16 before the dispatcher gathers them (a
        prompt step's): when some expert gets more rows than the grouped kernel takes, run_grouped takes
        the experts one by one through oneDNN's bf16 GEMMs, which round their input and give bf16
        outputs anyway, so the result is the same. Rows in one process only (other dispatchers send the
        rows they gather to other ranks)."""
        stack = self.gate_up
        if not (
            isinstance(self.dispatch, LocalDispatch)
            and x.dtype == torch.float32
            and ids.numel() > STACKED_MAX_ROWS
            and stack is not None
            and stack.quant is None
            and stack.weight.dtype == torch.bfloat16
            and kernels.onednn_gemm(stack.weight)
        ):
            return False
        return int(torch.bincount(ids.flatten()).max()) > self._grouped_kernel_rows()

    def _grouped_kernel_rows(self) -> int:
        """The most rows per expert for which run_grouped takes the CPU grouped kernel."""
        stack = self.gate_up
        tiles = kernels.prepare_cpu_kernels() and kernels.amx_tiles_fit(
            stack.weight, stack.weight.shape[1] // 2
        )
        return TILES_MAX_ROWS if tiles else STACKED_MAX_ROWS

    def _count(self, ids: torch.Tensor, valid: torch.Tensor | None) -> None:
        counts, layer_id = self.counted
        counts.add(layer_id, ids, valid)

    @property
    def routes_on_device(self) -> bool:
        """Whether run_on_device can serve this layer: a dispatcher that can, float or block-FP8 weights
        stacked, or integer ones on the CPU (whose grouped kernels take device offsets; elsewhere integer
        experts keep the path that reads counts back)."""
        stack = self.gate_up
        integer_ok = (
            stack is not None
            and stack.weight.device.type == "cpu"
            and not kernels.use_triton(stack.weight)
            and kernels.prepare_cpu_kernels()
        )
        return self.dispatch.routes_on_device and stack is not None and (stack.quant is None or integer_ok)

    def _small_batch_on_device(self, x: torch.Tensor) -> bool:
        # No expert can get more rows than x has: where run_grouped would pick the kernel for any
        # routing, the device path gives the same result without reading counts back.
        return (
            isinstance(self.dispatch, LocalDispatch)
            and self.gate_up is not None
            and self.gate_up.quant is None
            and (
                kernels.use_triton(x)  # the grouped MoE kernel: any batch, no counts read back
                or kernels.uses_grouped_linear_kernel(x, x.shape[0], self.gate_up.weight, STACKED_MAX_ROWS)
            )
        )

    def run_on_device(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        shared: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The routed experts with counts and offsets kept on the device (the dispatcher sorts the
        (token, expert) pairs by expert; `run_by_offsets` finds each expert's rows by its offsets)."""
        if not self.routes_on_device:
            raise RuntimeError(
                "run_on_device needs stacked experts (stack_experts) and a dispatcher whose ranks all see "
                "the same rows (one process, or expert parallelism inside one tensor-parallel group)"
            )
        return self.dispatch.route_on_device(x, weights, ids, self.run_by_offsets, shared, residual)

    def run_by_offsets(
        self, x_sorted: torch.Tensor, sorted_ids: torch.Tensor, offsets: torch.Tensor, most_rows: int
    ) -> torch.Tensor:
        """Local expert e on rows offsets[e]:offsets[e+1] of x_sorted: the grouped MoE kernel (Triton; for
        block-FP8 experts on the CPU its reference), the CPU grouped kernel, else every expert padded to
        `most_rows`, the most any can get."""
        if kernels.use_triton(x_sorted) or self.gate_up.block_scale is not None:
            return self.run_moe_kernel(x_sorted, offsets)
        if self.gate_up.quant is not None or kernels.grouped_linear_on_cpu(x_sorted, self.gate_up.weight):
            return self.run_grouped_kernel(x_sorted, offsets)
        return self.run_stacked(x_sorted, sorted_ids, offsets[:-1], most_rows)

    def stack_experts(self) -> None:
        """Stack the local experts' weights for inference on small batches (see run_grouped).

        Each expert's tensors become views of the stacks, so nothing is held twice and the experts still
        work one by one. Plain float, block-FP8 and integer weights stack.
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
                return self.run_grouped_kernel(
                    x_sorted, torch.tensor(list(accumulate(local_counts, initial=0)))
                )
        elif stack is not None and kernels.use_triton(x_sorted):
            offsets = torch.tensor(list(accumulate(local_counts, initial=0)), device=x_sorted.device)
            return self.run_moe_kernel(x_sorted, offsets)
        elif stack is not None and stack.block_scale is None:  # on the CPU FP8 experts go one by one
            if kernels.uses_grouped_linear_kernel(
                x_sorted, largest, stack.weight, self._grouped_kernel_rows()
            ):
                return self.run_grouped_kernel(
                    x_sorted, torch.tensor(list(accumulate(local_counts, initial=0)))
                )
            busy = sum(n > 0 for n in local_counts)
            # Stacked only when most experts have rows: the batched GEMM reads every expert's weights.
            if 2 * busy >= len(local_counts) and largest <= STACKED_MAX_ROWS:
                rows = torch.tensor(local_counts, device=x_sorted.device)
                group = torch.arange(len(local_counts), device=x_sorted.device).repeat_interleave(rows)
                return self.run_stacked(x_sorted, group, rows.cumsum(0) - rows, kernels.padded_rows(largest))
            if kernels.onednn_gemm(stack.weight):
                return self.run_per_expert_onednn(x_sorted, local_counts)
        out = torch.empty_like(x_sorted)
        start = 0
        for j, n in enumerate(counts):
            if n:
                out[start : start + n] = self.experts[str(j)](x_sorted[start : start + n])
                start += n
        return out

    def run_per_expert_onednn(self, x_sorted: torch.Tensor, local_counts: list[int]) -> torch.Tensor:
        """The local experts one by one through oneDNN's bf16 GEMMs (a prompt step's many rows): x_sorted
        converted once into a padded buffer (bf16 rows, gathered so, read in place); per expert its
        stacked [gate; up] GEMM, the SiLU gate and the down GEMM on its rows rounded up
        (kernels.padded_rows: oneDNN's compiled kernels reused). The extra rows read the next experts'
        rows or a zero tail (a padded copy of the last experts' rows); their outputs are dropped."""
        gate_up_w, down_w = self.gate_up.weight, self.down.weight
        total = x_sorted.shape[0]
        if x_sorted.dtype == gate_up_w.dtype:  # gathered in bf16: only the last experts need a padded copy
            xp = x_sorted
        else:
            spare = max(kernels.padded_rows(n) - n for n in local_counts)
            xp = kernels.padded_copy(x_sorted, gate_up_w.dtype, total + spare)
        out = torch.empty_like(x_sorted)
        start = 0
        for e, n in enumerate(local_counts):
            if n:
                padded = kernels.padded_rows(n)
                rows = xp[start : start + padded]
                if rows.shape[0] < padded:
                    rows = kernels.padded_copy(rows[:n], gate_up_w.dtype, padded)
                act = kernels.silu_mul(*F.linear(rows, gate_up_w[e]).chunk(2, dim=-1))
                out[start : start + n] = F.linear(act, down_w[e])[:n]
                start += n
        return out

    def run_grouped_kernel(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The local experts through the CPU grouped kernels (float or integer), local expert e on rows
        offsets[e]:offsets[e+1]: no padding, idle experts' weights unread."""
        return self.down.grouped(self.gate_up.grouped(x_sorted, offsets, gated=True), offsets)

    def run_moe_kernel(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The local experts through the grouped MoE kernel, local expert e on rows offsets[e]:offsets[e+1]
        (offsets on the device, never read back): one launch per projection, SiLU gating in the first."""
        gate_up, down = self.gate_up, self.down
        return kernels.moe_experts(
            x_sorted, offsets, gate_up.weight, down.weight, gate_up.block_scale, down.block_scale
        )

    def run_stacked(
        self, x_sorted: torch.Tensor, group: torch.Tensor, first_row: torch.Tensor, width: int
    ) -> torch.Tensor:
        """The local experts as two batched GEMMs: row i of x_sorted belongs to local expert group[i],
        whose rows start at first_row[group[i]]; each expert's rows zero-padded to `width`."""
        gate_up_w, down_w = self.gate_up.weight, self.down.weight
        n_local = gate_up_w.shape[0]
        # Row i of expert e's group goes to padded slot e * width + i.
        slot = group * width + torch.arange(x_sorted.shape[0], device=x_sorted.device) - first_row[group]
        padded = x_sorted.new_zeros(n_local * width, x_sorted.shape[1])
        padded[slot] = x_sorted
        # In the weights' dtype (bf16 weights under fp32 activations on the CPU: a bf16 batched GEMM).
        padded = padded.to(gate_up_w.dtype).view(n_local, width, -1)
        gate_up = torch.bmm(padded, gate_up_w.transpose(1, 2)).flatten(0, 1)
        act = kernels.silu_mul(*gate_up.chunk(2, dim=-1)).view(n_local, width, -1)
        return torch.bmm(act, down_w.transpose(1, 2)).view(n_local * width, -1)[slot].to(x_sorted.dtype)
