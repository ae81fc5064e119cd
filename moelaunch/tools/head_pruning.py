"""Attention-head pruning: keep, in every layer, the H heads that contribute most to the attention
output on calibration prompts.

A head's importance is the mean norm of what it adds to the residual stream: its value output times
its columns of o_proj. In MLA a head owns its rows of the query up-projection (q_b_proj or q_proj),
its rows of kv_b_proj (its keys' no-rope part and its values) and its columns of o_proj; the latent
(c_kv, k_pe) is shared by all heads and stays whole.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moelaunch.model import ModelArgs, Transformer, args_from_hf_config, load_model
from moelaunch.model.attention import MLA
from moelaunch.model.checkpoint import check_new_checkpoint_dir
from moelaunch.model.transformer import checkpoint_name
from moelaunch.tools.calibration import calibration_sequences
from moelaunch.tools.checkpoint_writer import (
    check_finite,
    read_config,
    read_tensors,
    write_checkpoint,
)
from moelaunch.tools.expert_pruning import top_k_ids

_ATTN_TENSOR = re.compile(r"model\.layers\.(\d+)\.self_attn\.(q_b_proj|q_proj|kv_b_proj|o_proj)\.weight")


def heads_config(config: dict[str, Any], h: int) -> dict[str, Any]:
    """config.json with h attention heads; a ValueError names the range."""
    n = int(config["num_attention_heads"])
    if not 1 <= h <= n:
        raise ValueError(f"{h} heads: the model has {n} attention heads per layer; choose 1..{n}")
    new = {**config, "num_attention_heads": h}
    if "num_key_value_heads" in config:  # MLA has one key/value head per query head
        new["num_key_value_heads"] = h
    return new


@torch.inference_mode()
def head_importance(model: Transformer, sequences: list[list[int]]) -> dict[int, torch.Tensor]:
    """Per layer (checkpoint index), each head's summed norm of its contribution through o_proj."""
    scores: dict[int, torch.Tensor] = {}
    handles = []

    def hook_for(layer: int, attn: MLA):
        def hook(_o_proj: nn.Module, inputs: tuple[torch.Tensor]) -> None:
            values = inputs[0].float().view(-1, attn.n_heads, attn.v_dim)  # [N, H, v]
            w_o = attn.o_proj.dense_weight(torch.float32).view(-1, attn.n_heads, attn.v_dim)  # [dim, H, v]
            contribution = torch.einsum("nhv,dhv->nhd", values, w_o)
            scores[layer] += contribution.norm(dim=-1).sum(dim=0)

        return hook

    for name, module in model.named_modules():
        if isinstance(module, MLA):
            layer = int(checkpoint_name(name, model.args).split(".")[2])
            scores[layer] = torch.zeros(module.n_heads)
            handles.append(module.o_proj.register_forward_pre_hook(hook_for(layer, module)))
    try:
        for seq in sequences:
            ids = torch.tensor([seq])
            hidden = model.hidden_states(ids)
            for depth in range(len(model.mtp) if len(seq) > 1 else 0):
                model.mtp_logits(hidden[:, :-1], ids[:, 1:], depth=depth)
    finally:
        for h in handles:
            h.remove()
    return scores


def prune_head_tensors(
    tensors: dict[str, torch.Tensor], kept: dict[int, list[int]], args: ModelArgs
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors with only layer L's heads kept[L] (in that order)."""
    n = args.num_attention_heads
    out = {}
    for name, tensor in tensors.items():
        match = _ATTN_TENSOR.fullmatch(name)
        if match is None or int(match[1]) not in kept:
            out[name] = tensor
            continue
        ids = kept[int(match[1])]
        if match[2] == "o_proj":  # [dim, H * v]: a head's columns
            out[name] = tensor.view(tensor.shape[0], n, -1)[:, ids].reshape(tensor.shape[0], -1)
        else:  # [H * per_head, in]: a head's rows
            out[name] = tensor.view(n, -1, tensor.shape[1])[ids].reshape(-1, tensor.shape[1])
    return out


def prune_heads(
    src: str | Path, out: str | Path, h: int, calibration: str | Path | None = None
) -> dict[int, list[int]]:
    """Write `out`: `src` with each layer's h most important heads; returns the heads kept per layer."""
    check_new_checkpoint_dir(src, out)
    config = read_config(src)
    new_config = heads_config(config, h)
    check_finite(src)
    sequences = calibration_sequences(src, calibration)
    importance = head_importance(load_model(src), sequences)
    kept = {layer: top_k_ids(score, h) for layer, score in importance.items()}
    write_checkpoint(
        src, out, prune_head_tensors(read_tensors(src), kept, args_from_hf_config(config)), new_config
    )
    return kept
