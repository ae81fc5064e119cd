"""One rank's shard of the Transformer (model/sharding.py's ModelShard on a mesh): its pipeline stage's
layers, its TP slices of attention heads, dense MLPs, shared experts and vocab, and its EP share of the
routed experts. The model is built from it directly; module names stay the checkpoint's, so the ordinary
loader fills it, reading only owned slices."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from moelaunch.model.config import ModelArgs, load_args
from moelaunch.model.expert_dispatch import ExpertDispatch, LocalDispatch
from moelaunch.model.linear import Linear
from moelaunch.model.loading import load_model
from moelaunch.model.sharding import WHOLE
from moelaunch.model.transformer import Transformer
from moelaunch.model.weight_spec import WeightSpec
from moelaunch.parallel.expert_parallel import AllToAllDispatch, ExpertPlacement
from moelaunch.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from moelaunch.parallel.mesh import LayoutError, MeshShape, ParallelMesh
from moelaunch.parallel.stages import assign_stages


def check_layout(args: ModelArgs, shape: MeshShape) -> None:
    """Fail early, with the fix, when the model does not split over the layout."""
    problems = []
    if args.num_attention_heads % shape.tp:
        problems.append(f"num_attention_heads={args.num_attention_heads} is not divisible by tp={shape.tp}")
    if args.vocab_size % shape.tp:
        problems.append(f"vocab_size={args.vocab_size} is not divisible by tp={shape.tp}")
    if args.intermediate_size % shape.tp or args.moe_intermediate_size % shape.tp:
        problems.append(f"MLP widths are not divisible by tp={shape.tp}")
    if args.n_routed_experts and args.n_routed_experts % shape.ep:
        problems.append(f"n_routed_experts={args.n_routed_experts} is not divisible by ep=dp*tp={shape.ep}")
    if shape.pp > args.num_hidden_layers:
        problems.append(f"pp={shape.pp} exceeds num_hidden_layers={args.num_hidden_layers}")
    if problems:
        raise LayoutError("; ".join(problems) + ": choose other --tp/--dp/--pp")


class MeshShard:
    """The part of the model that `mesh`'s rank holds; `placement`: where each routed expert lives
    (default: contiguous blocks over the EP group), overridden per MoE layer by `layer_placements`
    (decoder layer index -> placement, e.g. EPLB's)."""

    def __init__(
        self,
        args: ModelArgs,
        mesh: ParallelMesh,
        placement: ExpertPlacement | None = None,
        layer_placements: Mapping[int, ExpertPlacement] | None = None,
    ) -> None:
        check_layout(args, mesh.shape)
        self.mesh = mesh
        self.tp_size = mesh.tp.size
        self.first_stage, self.last_stage = mesh.is_first_stage, mesh.is_last_stage
        self.whole = mesh.shape.world == 1
        self.stage_layers = set(assign_stages(args, mesh.shape.pp)[mesh.pp_index])
        if placement is None and args.n_routed_experts:
            placement = ExpertPlacement.contiguous(args.n_routed_experts, mesh.shape.ep)
        self.placement = placement
        self.layer_placements = dict(layer_placements or {})

    def holds_layer(self, layer_id: int) -> bool:
        return layer_id in self.stage_layers

    # With tp=1 nothing is split or summed: the plain layers, so the step makes no collective calls for them.
    def column(self, in_features: int, out_features: int) -> Linear:
        if self.tp_size == 1:
            return WHOLE.column(in_features, out_features)
        return ColumnParallelLinear(in_features, out_features, self.mesh.tp)

    def row(self, in_features: int, out_features: int) -> Linear:
        if self.tp_size == 1:
            return WHOLE.row(in_features, out_features)
        return RowParallelLinear(in_features, out_features, self.mesh.tp)

    def embedding(self, vocab_size: int, dim: int) -> nn.Module:
        if self.tp_size == 1:
            return WHOLE.embedding(vocab_size, dim)
        return VocabParallelEmbedding(vocab_size, dim, self.mesh.tp)

    def head(self, dim: int, vocab_size: int) -> Linear:
        if self.tp_size == 1:
            return WHOLE.head(dim, vocab_size)
        return VocabParallelHead(dim, vocab_size, self.mesh.tp)

    def heads_max(self, x: torch.Tensor) -> torch.Tensor:
        return self.mesh.tp.all_reduce_max(x)

    def placement_of(self, layer_id: int) -> ExpertPlacement | None:
        return self.layer_placements.get(layer_id, self.placement)

    def expert_dispatch(self, n_experts: int, layer_id: int) -> ExpertDispatch:
        if self.mesh.ep.size == 1:  # every expert is here: nothing to exchange
            return LocalDispatch(n_experts)
        return AllToAllDispatch(self.placement_of(layer_id), self.mesh.ep, self.mesh.tp)


def weight_placements(
    weights: WeightSpec, args: ModelArgs, ep: int
) -> tuple[ExpertPlacement | None, dict[int, ExpertPlacement]]:
    """The expert placements `weights` asks for: every layer's (None: contiguous), and per layer."""

    def placement(owners: list[list[int]]) -> ExpertPlacement:
        return ExpertPlacement.from_map(owners, args.n_routed_experts, ep)

    default = None if weights.expert_placement is None else placement(weights.expert_placement)
    return default, {int(i): placement(o) for i, o in (weights.layer_expert_placement or {}).items()}


def load_shard(weights: WeightSpec, mesh: ParallelMesh, with_mtp: bool = False) -> Transformer:
    """Load only this rank's part of a checkpoint onto the mesh's device."""
    args = load_args(weights.model)
    default, per_layer = weight_placements(weights, args, mesh.shape.ep)
    return load_model(weights, mesh.device, with_mtp, MeshShard(args, mesh, default, per_layer))
