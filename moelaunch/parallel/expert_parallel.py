"""Expert parallelism: routed experts spread over the EP group, tokens moved to them and back.

Dispatch: after the gate, every (token, expert) pair is sent to a rank holding that expert with one
uneven all_to_all; the receiver runs its experts on what arrived and sends the results back with the
reverse all_to_all (combine); the sender weights and sums them per token. Routing weights never
travel. Under DP attention with TP, the ranks of a TP group hold the same tokens, so each sends only
its 1/tp share and the group gathers the combined results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelaunch import kernels
from moelaunch.model.expert_dispatch import RunByOffsets, RunExperts, combine_expert_outputs
from moelaunch.parallel.group import Group


@dataclass(frozen=True)
class ExpertPlacement:
    """owners[e] = the EP ranks holding a copy of expert e (more than one: a redundant copy)."""

    owners: tuple[tuple[int, ...], ...]
    ep_size: int

    @classmethod
    def contiguous(cls, n_experts: int, ep_size: int) -> ExpertPlacement:
        if n_experts % ep_size:
            raise ValueError(
                f"n_routed_experts={n_experts} does not split over ep={ep_size} ranks; "
                "pick dp*tp dividing the expert count or give an expert placement map"
            )
        per = n_experts // ep_size
        return cls(tuple((e // per,) for e in range(n_experts)), ep_size)

    @classmethod
    def from_map(cls, owners: list[list[int]], n_experts: int, ep_size: int) -> ExpertPlacement:
        if len(owners) != n_experts:
            raise ValueError(f"expert placement lists {len(owners)} experts, the model has {n_experts}")
        for e, ranks in enumerate(owners):
            if not ranks or any(not 0 <= r < ep_size for r in ranks):
                raise ValueError(
                    f"expert {e} placed on {ranks}: each expert needs owners in 0..{ep_size - 1}"
                )
        return cls(tuple(tuple(r) for r in owners), ep_size)

    def experts_of(self, ep_rank: int) -> list[int]:
        return [e for e, ranks in enumerate(self.owners) if ep_rank in ranks]

    def destinations(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """The EP rank each (token, expert) pair goes to; copies of an expert share its pairs in turn."""
        width = max(len(r) for r in self.owners)
        device = expert_ids.device
        table = torch.tensor([(list(r) * width)[:width] for r in self.owners], device=device)
        n_copies = torch.tensor([len(r) for r in self.owners], device=device)
        turn = torch.arange(expert_ids.numel(), device=device) % n_copies[expert_ids]
        return table[expert_ids, turn]


class AllToAllDispatch:
    """The MoE's expert dispatcher (model/expert_dispatch.py) when experts are spread over the EP group."""

    def __init__(self, placement: ExpertPlacement, ep: Group, tp: Group) -> None:
        self.placement = placement
        self.expert_ids = placement.experts_of(ep.index)
        self.n_experts = len(placement.owners)
        self.ep = ep
        self.tp = tp
        # Without data parallelism every EP rank holds the same rows: each can apply its own experts to
        # all of them and one all-reduce sums the results, with fixed shapes (route_on_device).
        self.routes_on_device = ep.ranks == tp.ranks
        # On the CPU whatever the default device (models are built on meta); moved on first use.
        local = torch.full((self.n_experts,), -1, dtype=torch.long, device="cpu")
        local[self.expert_ids] = torch.arange(len(self.expert_ids), device="cpu")
        self.local_index = local  # global expert id -> position among this rank's experts, or -1
        # route_on_device sums every rank's outputs: an expert with copies counts on its first owner only.
        self.counted_here = torch.tensor([ranks[0] == ep.index for ranks in placement.owners], device="cpu")

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        share = -(-x.shape[0] // self.tp.size)  # rows per TP rank, the last share padded
        return x[self.tp.index * share : (self.tp.index + 1) * share]

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        run: RunExperts,
        base: torch.Tensor | None,
        n_rows: int,
    ) -> torch.Tensor:
        k, n_experts = ids.shape[1], self.n_experts
        flat_ids = ids.flatten()
        dest = self.placement.destinations(flat_ids)
        # Grouped by destination, then by expert, so each receiver gets runs of rows per expert.
        key = dest * n_experts + flat_ids
        order = key.argsort(stable=True)
        token_of_slot = order // k
        # Per-(destination, expert) counts are the only metadata that travels: with the fixed order
        # they tell the receiver each arriving row's expert, so no ids need sending.
        sent = torch.bincount(key, minlength=self.ep.size * n_experts).view(self.ep.size, n_experts)
        received = self.ep.exchange_counts(sent)
        sends, recvs = sent.sum(1).tolist(), received.sum(1).tolist()
        arrived = self.ep.all_to_all(x.index_select(0, token_of_slot), sends, recvs)
        arrived_ids = (
            torch.arange(n_experts, device=x.device)
            .repeat(self.ep.size)
            .repeat_interleave(received.flatten())
        )
        computed = self._run_local(arrived, arrived_ids, run)
        back = self.ep.all_to_all(computed, recvs, sends)  # the reverse exchange: combine
        if self.tp.size == 1:
            return combine_expert_outputs(back, order, weights, base)
        # Each TP rank combined its share of the rows: the group gathers them, then adds the base.
        routed = combine_expert_outputs(back, order, weights)
        share = -(-n_rows // self.tp.size)
        padded = routed.new_zeros(share, routed.shape[1])
        padded[: routed.shape[0]] = routed
        routed = self.tp.all_gather_cat(padded, dim=0)[:n_rows]
        return routed if base is None else routed + base

    def route_on_device(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        run: RunByOffsets,
        base: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row through this rank's experts, the pairs of other ranks' experts (and of copies whose
        first owner is another rank) weighted 0 (other ranks' run through local expert 0 so that their
        outputs are finite), then the sum over the group."""
        if not self.routes_on_device:
            raise RuntimeError("route_on_device needs every EP rank to hold the same rows (dp=1)")
        if self.local_index.device != ids.device:
            self.local_index = self.local_index.to(ids.device)
            self.counted_here = self.counted_here.to(ids.device)
        local = self.local_index[ids]
        mine = self.counted_here[ids]
        rows, sorted_ids, offsets, slot = kernels.moe_sort_rows(x, local.clamp(min=0), len(self.expert_ids))
        y = run(rows, sorted_ids, offsets, ids.numel())
        # The shared experts' output (base) and the residual are whole on every rank: added once, on rank 0.
        first = self.ep.index == 0
        partial = kernels.moe_combine(y, slot, weights * mine, *((base, residual) if first else (None, None)))
        return self.ep.all_reduce(partial)

    def _run_local(self, rows: torch.Tensor, expert_ids: torch.Tensor, run: RunExperts) -> torch.Tensor:
        """Apply each row's expert; rows from different senders are regrouped by expert first."""
        order = expert_ids.argsort(stable=True)
        counts = torch.bincount(expert_ids, minlength=self.n_experts).tolist()
        out = torch.empty_like(rows)
        out[order] = run(rows.index_select(0, order), counts)
        return out
