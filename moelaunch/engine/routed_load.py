"""The engine's record of routed load: tokens per MoE layer and routed expert, counted on the device by
every rank (model/routed_counts.py) and summed over the ranks only when read, a collective every rank
joins at the same step (each DP replica, TP share and pipeline stage routes different rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelaunch.model.moe import MoE
from moelaunch.model.routed_counts import RoutedCounts
from moelaunch.model.transformer import Transformer
from moelaunch.parallel.eplb import max_over_mean, rank_loads
from moelaunch.parallel.expert_parallel import ExpertPlacement
from moelaunch.parallel.group import Group

# The window for callers that read only the whole run's total (eval, bench): the engine reads the load
# over the ranks every window steps, a host sync it should rarely pay inside a measured run.
TOTAL_ONLY_WINDOW = 1000


def moe_layer_ids(model: Transformer, with_mtp: bool) -> list[int]:
    """Every MoE layer of the whole model (not only this rank's stage), MTP layers after the decoder's."""
    args = model.args
    return [i for i in args.moe_layer_ids() if with_mtp or i < args.num_hidden_layers]


def moe_layers(model: Transformer) -> dict[int, MoE]:
    """This rank's MoE modules by layer id."""
    layers = [*model.model.layers.values(), *model.mtp]
    return {layer.layer_id: layer.mlp for layer in layers if isinstance(layer.mlp, MoE)}


class LoadRecorder:
    def __init__(self, model: Transformer, with_mtp: bool, window: int, device: torch.device) -> None:
        self.counts = RoutedCounts(
            moe_layer_ids(model, with_mtp), model.args.n_routed_experts, window, device
        )
        for layer_id, moe in moe_layers(model).items():
            moe.counted = (self.counts, layer_id)

    def summed(self, world: Group) -> torch.Tensor:
        """[2, layers, E] int64 on the CPU, the window's and the whole run's counts over every rank."""
        return world.all_reduce(self.counts.window_and_total()).cpu()


@dataclass
class LoadReport:
    """Routed load as rank 0 read it: `window` [layers, E] over the last steps, `total` since the start."""

    layer_ids: list[int]
    window: torch.Tensor
    total: torch.Tensor
    steps: int  # engine steps recorded when read
    window_steps: int
    top_k: int
    placements: dict[int, ExpertPlacement]  # each layer's expert placement when read
    rebalances: int  # placements applied since the start

    def tokens(self, counts: torch.Tensor) -> int:
        """Tokens the first MoE layer routed (each to top_k experts); MTP layers route fewer."""
        return int(counts[0].sum()) // self.top_k

    def by_layer(self, counts: torch.Tensor) -> dict[int, torch.Tensor]:
        """`counts` (window or total) by layer id: write_expert_load's (model/expert_load_file.py)."""
        return dict(zip(self.layer_ids, counts, strict=True))

    def expert_imbalance(self, counts: torch.Tensor) -> dict[int, float]:
        """max/mean tokens per expert, per layer (1.0: even)."""
        mean = counts.double().mean(1).clamp(min=1e-9)
        return {layer: (counts[i].max() / mean[i]).item() for i, layer in enumerate(self.layer_ids)}

    def rank_imbalance(self, counts: torch.Tensor) -> dict[int, float]:
        """max/mean routed rows per EP rank, per layer, under each layer's placement."""
        return {
            layer: max_over_mean(counts[i], self.placements[layer]) for i, layer in enumerate(self.layer_ids)
        }

    def rank_rows(self, counts: torch.Tensor) -> list[float]:
        """Routed rows each EP rank ran, summed over the layers."""
        per_layer = [rank_loads(counts[i], self.placements[layer]) for i, layer in enumerate(self.layer_ids)]
        return torch.stack(per_layer).sum(0).tolist()
