"""The student of a distillation: the teacher's architecture with fewer layers and fewer routed
experts, started from the teacher's own weights.

It keeps evenly spaced teacher layers (always the first and the last, so the dense layers stay first),
the MTP layers, and in each MoE layer the experts the teacher selects most on calibration prompts.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from moelaunch.model import ModelArgs
from moelaunch.tools.expert_pruning import prune_expert_tensors, routing_config, top_k_ids

_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)")


def kept_layers(n_layers: int, layers: int) -> list[int]:
    """`layers` evenly spaced indices of n_layers, first and last included."""
    if not 1 <= layers <= n_layers:
        raise ValueError(f"{layers} layers: the teacher has {n_layers} decoder layers; choose 1..{n_layers}")
    if layers == 1:
        return [0]
    return [round(i * (n_layers - 1) / (layers - 1)) for i in range(layers)]


def student_config(
    teacher: dict[str, Any],
    layers: int,
    experts: int,
    n_group: int | None = None,
    topk_group: int | None = None,
) -> dict[str, Any]:
    """config.json of the student; ValueErrors name the fix for sizes that cannot work."""
    config = routing_config(teacher, experts, n_group, topk_group)
    kept = kept_layers(int(teacher["num_hidden_layers"]), layers)
    dense = int(teacher.get("first_k_dense_replace") or 0)
    return {**config, "num_hidden_layers": layers, "first_k_dense_replace": sum(i < dense for i in kept)}


def student_tensors(
    teacher: dict[str, torch.Tensor],
    teacher_args: ModelArgs,
    layers: int,
    usage: dict[int, torch.Tensor],
    experts: int,
) -> dict[str, torch.Tensor]:
    """The student's checkpoint tensors from the teacher's: kept layers renumbered 0..L-1, MTP layers
    after them, each MoE layer's `experts` most used experts (usage: counts per teacher layer)."""
    n_main = teacher_args.num_hidden_layers
    new_index = {old: new for new, old in enumerate(kept_layers(n_main, layers))}
    new_index |= {n_main + k: layers + k for k in range(teacher_args.num_nextn_predict_layers)}
    renamed = {}
    for name, tensor in teacher.items():
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None:
            renamed[name] = tensor
        elif int(match[1]) in new_index:
            renamed[f"model.layers.{new_index[int(match[1])]}.{match[2]}"] = tensor
    kept = {new_index[old]: top_k_ids(counts, experts) for old, counts in usage.items() if old in new_index}
    return prune_expert_tensors(renamed, kept)
