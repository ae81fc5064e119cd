"""The MoE router: scores, optional group-limited selection, top-k, normalization, scaling."""

from __future__ import annotations

import torch
from torch import nn

from moelaunch import kernels
from moelaunch.model.config import ModelArgs


class Gate(nn.Module):
    """Returns (weights [N, k] fp32, expert ids [N, k]) for tokens x [N, dim].

    With noaux_tc (V3) a per-expert bias steers *which* experts are chosen but not their weights.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.n_experts = args.n_routed_experts
        self.n_groups = args.n_group
        self.topk_groups = args.topk_group
        self.scoring = args.scoring_func
        self.method = args.topk_method
        self.normalize = args.norm_topk_prob
        self.scale = args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        bias = torch.zeros(args.n_routed_experts) if args.uses_expert_bias else None
        self.register_buffer("e_score_correction_bias", bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grouped = self.method != "greedy" and self.n_groups > 1
        groups, kept = (self.n_groups, self.topk_groups) if grouped else (1, 1)
        return kernels.moe_gate(
            x,
            self.weight,
            self.e_score_correction_bias,
            self.top_k,
            groups,
            kept,
            self.scoring == "sigmoid",
            self.normalize,
            self.scale,
        )
