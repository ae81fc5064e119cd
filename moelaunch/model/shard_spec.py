"""Which part of a checkpoint tensor a module holds: rows or columns [start, end) along one dim.

A tensor-parallel layer is built with its `shard_spec`; the loader then reads only that slice of `weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    start: int
    end: int

    @classmethod
    def even(cls, dim: int, size: int, rank: int, world: int) -> ShardSpec:
        """Rank `rank`'s equal share of `size` (which must divide evenly)."""
        if size % world:
            raise ValueError(f"size {size} does not split evenly over {world} ranks")
        per = size // world
        return cls(dim, rank * per, (rank + 1) * per)


def weight_shard(module: nn.Module, attr: str) -> ShardSpec | None:
    """The slice of the checkpoint tensor that `module.attr` holds; None: all of it."""
    return getattr(module, "shard_spec", None) if attr == "weight" else None
