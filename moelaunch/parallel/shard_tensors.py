"""What one rank of a layout holds, found without starting anything: its shard, built by the real
builder (MeshShard) on the meta device, listed tensor by tensor with the slice TP gives it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moelaunch.model.config import ModelArgs
from moelaunch.model.shard_spec import weight_shard
from moelaunch.model.transformer import Transformer
from moelaunch.parallel.expert_parallel import ExpertPlacement
from moelaunch.parallel.mesh import MeshShape, ParallelMesh
from moelaunch.parallel.parallelize import MeshShard


@dataclass(frozen=True)
class ShardTensor:
    """A checkpoint tensor as a rank holds it: `shape` is its 1/tp slice along split_dim (None: whole)."""

    name: str
    shape: tuple[int, ...]
    split_dim: int | None = None
    tp: int = 1

    @property
    def full_shape(self) -> tuple[int, ...]:
        return tuple(n * self.tp if i == self.split_dim else n for i, n in enumerate(self.shape))


def shard_tensors(
    args: ModelArgs,
    shape: MeshShape,
    rank: int,
    placement: ExpertPlacement | None,
    layer_placements: Mapping[int, ExpertPlacement] | None = None,
) -> list[ShardTensor]:
    """The tensors mesh position `rank` loads (parameters and the router bias), in module order; the
    MTP layer is left out, as it is loaded only for speculative decoding."""
    mesh = ParallelMesh.planned(shape, rank)
    with torch.device("meta"):
        shard = Transformer(args, with_mtp=False, shard=MeshShard(args, mesh, placement, layer_placements))
    modules = dict(shard.named_modules())
    tensors = []
    # The state dict is what the loader fills: no rope tables, no unset FP8 scales.
    for name, tensor in shard.state_dict().items():
        module_name, _, attr = name.rpartition(".")
        spec = weight_shard(modules[module_name], attr)
        split = (spec.dim, shape.tp) if spec else (None, 1)
        tensors.append(ShardTensor(name, tuple(tensor.shape), *split))
    return tensors
