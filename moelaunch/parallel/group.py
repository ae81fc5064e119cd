"""A process group plus the few collectives the sharded model uses; a group of one is a no-op."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Group:
    ranks: list[int]  # global ranks, in group order
    index: int  # this process's position in `ranks`
    pg: dist.ProcessGroup | None  # None when the group has one member

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.pg)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.pg)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.pg)
        return x

    def all_gather_cat(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every member's equally shaped `x` along `dim`, in group order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.pg)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src_index: int) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, self.ranks[src_index], group=self.pg)
        return x

    def isend(self, x: torch.Tensor, dst_index: int) -> dist.Work:
        """Start sending `x` to member `dst_index`, which receives it with recv into a same-shaped tensor."""
        return dist.isend(x.contiguous(), self.ranks[dst_index])

    def recv(self, x: torch.Tensor, src_index: int) -> torch.Tensor:
        """Fill `x` with what member `src_index` sends (isend)."""
        dist.recv(x, self.ranks[src_index])
        return x

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows x[...] in blocks of send_counts to each member; returns the blocks received, in order."""
        if self.size == 1:
            return x
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.pg)
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """Each member's count of rows it will send to this one (the transpose of send_counts)."""
        if self.size == 1:
            return send_counts
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.pg)
        return recv


def make_group(ranks: list[int], my_rank: int, pg: dist.ProcessGroup | None) -> Group | None:
    if my_rank not in ranks:
        return None
    return Group(ranks, ranks.index(my_rank), pg if len(ranks) > 1 else None)
