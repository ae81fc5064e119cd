"""Structured expert pruning: keep, in every MoE layer, the K routed experts that calibration tokens
select most often, renumbered 0..K-1 in their old order.

The gate's rows and its selection bias follow their experts, so each kept expert is scored and chosen
exactly as before; only the dropped experts' share of tokens goes to the next-best kept ones. Shared
experts are kept whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moelaunch.model import Transformer, args_from_hf_config, load_model
from moelaunch.model.checkpoint import check_new_checkpoint_dir
from moelaunch.model.expert_load import ExpertLoad
from moelaunch.model.transformer import checkpoint_name
from moelaunch.tools.calibration import calibration_sequences
from moelaunch.tools.checkpoint_writer import (
    check_finite,
    read_config,
    read_tensors,
    write_checkpoint,
)

_MLP_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.(.+)")


def routing_config(
    config: dict[str, Any], k: int, n_group: int | None = None, topk_group: int | None = None
) -> dict[str, Any]:
    """config.json with k routed experts per layer (and n_group/topk_group if given), checked the way
    the gate will use it; a ValueError names the fix."""
    n = int(config.get("n_routed_experts") or 0)
    if n == 0:
        raise ValueError("the model has no routed experts to prune")
    if not 1 <= k <= n:
        raise ValueError(f"{k} experts: the model has {n} routed experts per layer; choose 1..{n}")
    groups = n_group if n_group is not None else int(config.get("n_group") or 1)
    top_groups = topk_group if topk_group is not None else min(int(config.get("topk_group") or 1), groups)
    per_token = int(config.get("num_experts_per_tok") or 0)
    if groups < 1 or k % groups:
        raise ValueError(
            f"{k} experts do not divide into n_group={groups} groups: choose a multiple of {groups}"
        )
    if per_token > k:
        raise ValueError(
            f"{k} experts are fewer than num_experts_per_tok={per_token}: keep at least {per_token}"
        )
    if not 1 <= top_groups <= groups:
        raise ValueError(f"topk_group={top_groups} must be between 1 and n_group={groups}")
    new = {**config, "n_routed_experts": k, "n_group": groups, "topk_group": top_groups}
    args = args_from_hf_config(new)
    if groups > 1 and args.topk_method != "greedy":
        size = k // groups
        if args.uses_expert_bias and size < 2:
            # noaux_tc scores a group by its two best experts.
            raise ValueError(
                f"{k} experts in n_group={groups} groups leave {size} per group, and this router scores a "
                f"group by its best two: choose n_group (--n-group) of at most {k // 2}"
            )
        if top_groups * size < per_token:
            raise ValueError(
                f"topk_group={top_groups} groups of {size} experts cannot hold num_experts_per_tok="
                f"{per_token}: raise topk_group (--topk-group) or lower n_group (--n-group)"
            )
    return new


def _layer_of(module_name: str, model: Transformer) -> int:
    # Checkpoint names number MTP layers after the main ones, so both map to one index.
    return int(checkpoint_name(module_name, model.args).split(".")[2])


@torch.inference_mode()
def count_expert_usage(model: Transformer, sequences: list[list[int]]) -> dict[int, torch.Tensor]:
    """Per MoE layer (its checkpoint index), how many calibration tokens selected each routed expert.

    MTP layers see the main model's hidden states and the next tokens, as in speculative decoding.
    """
    load = ExpertLoad(model)
    with load:
        for seq in sequences:
            ids = torch.tensor([seq])
            hidden = model.hidden_states(ids)
            for depth in range(len(model.mtp) if len(seq) > 1 else 0):
                model.mtp_logits(hidden[:, :-1], ids[:, 1:], depth=depth)
    return {_layer_of(name, model): counts.clone() for name, counts in load.counts.items()}


def top_k_ids(scores: torch.Tensor, k: int) -> list[int]:
    """The ids of the k largest scores (here: selection counts), ascending; ties go to the lower id."""
    ranked = sorted(range(len(scores)), key=lambda j: (-float(scores[j]), j))
    return sorted(ranked[:k])


def prune_expert_tensors(
    tensors: dict[str, torch.Tensor], kept: dict[int, list[int]]
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors with only layer L's experts kept[L], renumbered 0..K-1 in that order."""
    out = {}
    for name, tensor in tensors.items():
        match = _MLP_TENSOR.fullmatch(name)
        if match is None or int(match[1]) not in kept:
            out[name] = tensor
            continue
        layer, rest, ids = int(match[1]), match[2], kept[int(match[1])]
        if rest in ("gate.weight", "gate.e_score_correction_bias"):
            out[name] = tensor[ids].clone()
        elif rest.startswith("experts."):
            expert, tail = rest[len("experts.") :].split(".", 1)
            if int(expert) in ids:
                out[f"model.layers.{layer}.mlp.experts.{ids.index(int(expert))}.{tail}"] = tensor
        else:  # shared experts
            out[name] = tensor
    return out


@dataclass
class ExpertPruning:
    counts: dict[int, torch.Tensor]  # per MoE layer, calibration tokens per original expert
    kept: dict[int, list[int]]  # per MoE layer, the original ids kept (new id = position)

    def kept_share(self) -> dict[int, float]:
        """Per layer, the share of calibration selections that went to kept experts."""
        return {
            layer: float(c[self.kept[layer]].sum() / c.sum().clamp(min=1)) for layer, c in self.counts.items()
        }


def prune_experts(
    src: str | Path,
    out: str | Path,
    k: int,
    calibration: str | Path | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
) -> ExpertPruning:
    """Write `out`: `src` with each MoE layer's k most used routed experts (see the module doc)."""
    check_new_checkpoint_dir(src, out)
    config = routing_config(read_config(src), k, n_group, topk_group)
    check_finite(src)
    sequences = calibration_sequences(src, calibration)
    counts = count_expert_usage(load_model(src), sequences)
    result = ExpertPruning(counts, {layer: top_k_ids(c, k) for layer, c in counts.items()})
    write_checkpoint(src, out, prune_expert_tensors(read_tensors(src), result.kept), config)
    return result
