"""Which part of the model a process builds, and the layers it builds it from.

The model's constructors take a ModelShard and ask it for every projection that tensor parallelism
splits (column: output features split; row: input features split, partial results summed), for the
vocab-split embedding and head, for the pipeline stage's layers and for the MoE's expert dispatcher.
WholeModel, the default, is the whole model in one process; parallel/ provides one rank's shard of a
mesh. Module names stay the checkpoint's either way, so one loader fills both.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from moelaunch.model.expert_dispatch import ExpertDispatch, LocalDispatch
from moelaunch.model.linear import Linear


class ModelShard(Protocol):
    tp_size: int  # ranks a column or row projection is split over
    first_stage: bool  # holds the embedding
    last_stage: bool  # holds the final norm, the LM head and the MTP layers
    whole: bool  # holds every tensor of the checkpoint (the loader then checks that each one is used)

    def holds_layer(self, layer_id: int) -> bool: ...

    def column(self, in_features: int, out_features: int) -> Linear: ...

    def row(self, in_features: int, out_features: int) -> Linear: ...

    def embedding(self, vocab_size: int, dim: int) -> nn.Module: ...

    def head(self, dim: int, vocab_size: int) -> Linear: ...

    def expert_dispatch(self, n_experts: int, layer_id: int) -> ExpertDispatch:
        """The dispatcher of decoder layer `layer_id`'s MoE (placements may differ per layer)."""
        ...

    def heads_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of `x` over the ranks that split the attention heads (x computed over
        this rank's heads), so a choice made from the best head is the same on every rank."""
        ...


class WholeModel:
    """Everything, in one process."""

    tp_size = 1
    first_stage = last_stage = whole = True

    def holds_layer(self, layer_id: int) -> bool:
        return True

    def column(self, in_features: int, out_features: int) -> Linear:
        return Linear(in_features, out_features)

    row = column
    head = column

    def embedding(self, vocab_size: int, dim: int) -> nn.Module:
        # An uninitialized weight (the loader fills it): nn.Embedding's random init would, on the meta
        # device, import torch._dynamo and sympy for nothing (~0.3 s and ~90 MB per process).
        return nn.Embedding(vocab_size, dim, _weight=torch.empty(vocab_size, dim))

    def expert_dispatch(self, n_experts: int, layer_id: int) -> ExpertDispatch:
        return LocalDispatch(n_experts)

    def heads_max(self, x: torch.Tensor) -> torch.Tensor:
        return x


WHOLE = WholeModel()
