"""Live expert load balancing: every `interval` steps every rank computes the same placements from the
routed load of the window (summed over all ranks), moves the expert weights between the EP ranks by
collective, and swaps each MoE layer's dispatcher; the next step routes on the new map."""

from __future__ import annotations

import os

import torch

from moelaunch.engine.config import EplbConfig
from moelaunch.engine.routed_load import moe_layers
from moelaunch.model.config import ModelArgs
from moelaunch.model.transformer import Transformer
from moelaunch.parallel.eplb import balanced_placements
from moelaunch.parallel.expert_moves import move_layer
from moelaunch.parallel.expert_parallel import ExpertPlacement
from moelaunch.parallel.mesh import MeshShape, ParallelMesh


def ep_nodes(ep_size: int) -> int:
    """Nodes the EP group spans: ranks are numbered node by node, LOCAL_WORLD_SIZE of them per node."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ep_size))
    return ep_size // per_node if per_node < ep_size and ep_size % per_node == 0 else 1


def check_eplb(config: EplbConfig, args: ModelArgs, shape: MeshShape) -> None:
    """Refuse, before the model loads, what the live rebalance cannot do on this model and layout."""
    where = f"engine.eplb (tp={shape.tp}, dp={shape.dp}, pp={shape.pp})"
    if not args.n_routed_experts:
        raise ValueError(f"{where}: the model has no routed experts; remove engine.eplb")
    if shape.ep == 1:
        raise ValueError(
            f"{where}: one EP rank holds every expert, there is nothing to balance; use tp*dp > 1"
        )
    if shape.pp > 1:
        raise ValueError(f"{where}: the live rebalance runs on pp=1 layouts only; use tp/dp or remove eplb")
    try:  # the placement's own checks on the sizes, from an empty load
        balanced_placements(
            torch.zeros(1, args.n_routed_experts), shape.ep, config.redundant_experts, args.n_group, 1
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def apply_placements(model: Transformer, mesh: ParallelMesh, placements: dict[int, ExpertPlacement]) -> int:
    """Move every listed MoE layer of this rank to its placement; returns the bytes this rank received."""
    layers = moe_layers(model)
    return sum(
        move_layer(layers[i], p, mesh.ep, mesh.tp) for i, p in sorted(placements.items()) if i in layers
    )


def rebalanced(
    config: EplbConfig, args: ModelArgs, ep_size: int, layer_ids: list[int], window: torch.Tensor
) -> dict[int, ExpertPlacement]:
    """The placements of the window's load [layers, E], by layer id."""
    placements = balanced_placements(
        window, ep_size, config.redundant_experts, args.n_group, ep_nodes(ep_size)
    )
    return dict(zip(layer_ids, placements, strict=True))


def redundant_expert_bytes(model: Transformer, config: EplbConfig, ep_size: int) -> int:
    """Bytes this rank will hold beyond its loaded experts once rebalanced: every rank then holds
    (experts + redundant) / ep of them per MoE layer."""
    slots = (model.args.n_routed_experts + config.redundant_experts) // ep_size
    total = 0
    for moe in moe_layers(model).values():
        expert = moe.experts[str(moe.local_ids[0])]
        per_expert = sum(t.numel() * t.element_size() for t in expert.state_dict().values())
        total += max(slots - len(moe.local_ids), 0) * per_expert
    return total
