"""The MoE router: scores, optional group-limited selection, top-k, normalization, scaling."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.method != "greedy" and self.n_groups > 1:
            choice = self._mask_groups(choice)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        grouped = choice.view(-1, self.n_groups, self.n_experts // self.n_groups)
        if self.e_score_correction_bias is None:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(self.topk_groups, dim=-1).indices
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
