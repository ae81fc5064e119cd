"""Tensor-parallel layers. Each is built with one rank's slice of a checkpoint tensor (its `shard_spec`,
which the loader reads) and adds the collective that makes the result whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelaunch.model.linear import Linear
from moelaunch.model.shard_spec import ShardSpec
from moelaunch.parallel.group import Group


class ColumnParallelLinear(Linear):
    """Output features split over the group; the output stays split (the next layer is row-parallel
    or works per head)."""

    def __init__(self, in_features: int, out_features: int, group: Group) -> None:
        spec = ShardSpec.even(0, out_features, group.index, group.size)
        super().__init__(in_features, spec.end - spec.start, spec)
        self.group = group


class RowParallelLinear(Linear):
    """Input features split over the group; partial products are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, group: Group) -> None:
        spec = ShardSpec.even(1, in_features, group.index, group.size)
        super().__init__(spec.end - spec.start, out_features, spec)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amax = None
        if self.quant is not None and self.quant.quantize_activations:
            # W8A8: each rank holds a slice of every row; quantized with the whole row's scale, the
            # products sum to what one process computes.
            amax = self.group.all_reduce_max(x.float().abs().amax(dim=-1))
        return self.group.all_reduce(super().forward(x, amax))


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding split over the group; each rank looks up the ids it holds, zeros the
    rest, and an all-reduce assembles the full embeddings."""

    def __init__(self, vocab_size: int, dim: int, group: Group) -> None:
        super().__init__()
        self.shard_spec = ShardSpec.even(0, vocab_size, group.index, group.size)
        self.weight = nn.Parameter(torch.empty(self.shard_spec.end - self.shard_spec.start, dim))
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard_spec.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill(outside[:, None], 0.0))


class VocabParallelHead(ColumnParallelLinear):
    """The LM head with vocab rows split over the group; logits are gathered to full width."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_cat(super().forward(x), dim=-1)
