"""What one rank of a layout holds, found without starting anything: its shard, built by the real
builder (MeshShard) on the meta device, listed tensor by tensor with the slice TP gives it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from moelaunch.model.config import ModelArgs
from moelaunch.model.quantization import IntQuant, int4_local_group, is_quantizable
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


def check_int4_slices(tensors: Iterable[ShardTensor], quant: IntQuant) -> None:
    """A ValueError naming the tensor and tp where a row-parallel int4 slice would run with local groups
    the kernels cannot take (`int4_local_group`): checked before anything loads, as the loader would
    refuse it."""
    for t in tensors:
        if t.split_dim == 1 and t.tp > 1 and is_quantizable(t.name, t.full_shape):
            width = t.shape[1]
            try:  # every rank's slice starts at a multiple of its width: rank 1's stands for all
                int4_local_group(quant.group_size, width, 2 * width, t.full_shape[1])
            except ValueError as e:
                raise ValueError(f"{t.name}: {e}") from None
