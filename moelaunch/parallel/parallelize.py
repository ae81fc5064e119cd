"""Build one rank's shard of the Transformer: its pipeline stage's layers, its TP slices of
attention heads, dense MLPs, shared experts and vocab, and its EP share of the routed experts.
Module names stay the checkpoint's, so the ordinary loader fills it, reading only owned slices."""

from __future__ import annotations

from dataclasses import replace

import torch

from moelaunch.model.attention import MLA
from moelaunch.model.config import ModelArgs
from moelaunch.model.loading import load_model
from moelaunch.model.mlp import MLP
from moelaunch.model.transformer import DecoderLayer, Transformer
from moelaunch.parallel.expert_parallel import ExpertParallelMoE, ExpertPlacement
from moelaunch.parallel.group import Group
from moelaunch.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from moelaunch.parallel.mesh import LayoutError, ParallelMesh
from moelaunch.parallel.stages import assign_stages


def check_layout(args: ModelArgs, mesh_tp: int, mesh_ep: int, pp: int) -> None:
    """Fail early, with the fix, when the model does not split over the layout."""
    problems = []
    if args.num_attention_heads % mesh_tp:
        problems.append(f"num_attention_heads={args.num_attention_heads} is not divisible by tp={mesh_tp}")
    if args.vocab_size % mesh_tp:
        problems.append(f"vocab_size={args.vocab_size} is not divisible by tp={mesh_tp}")
    if args.intermediate_size % mesh_tp or args.moe_intermediate_size % mesh_tp:
        problems.append(f"MLP widths are not divisible by tp={mesh_tp}")
    if args.n_routed_experts and args.n_routed_experts % mesh_ep:
        problems.append(f"n_routed_experts={args.n_routed_experts} is not divisible by ep=dp*tp={mesh_ep}")
    if pp > args.num_hidden_layers:
        problems.append(f"pp={pp} exceeds num_hidden_layers={args.num_hidden_layers}")
    if problems:
        raise LayoutError("; ".join(problems) + ": choose other --tp/--dp/--pp")


def _shard_mlp(mlp: MLP, dim: int, inter: int, tp: Group) -> None:
    mlp.gate_proj = ColumnParallelLinear(dim, inter, tp)
    mlp.up_proj = ColumnParallelLinear(dim, inter, tp)
    mlp.down_proj = RowParallelLinear(inter, dim, tp)


def _shard_layer(layer: DecoderLayer, args: ModelArgs, mesh: ParallelMesh, placement: ExpertPlacement | None):
    tp = mesh.tp
    heads = args.num_attention_heads // tp.size
    attn = MLA(args, n_heads=heads)
    q_out = args.num_attention_heads * args.qk_head_dim
    if args.q_lora_rank:
        attn.q_b_proj = ColumnParallelLinear(args.q_lora_rank, q_out, tp)
    else:
        attn.q_proj = ColumnParallelLinear(args.hidden_size, q_out, tp)
    kv_out = args.num_attention_heads * (args.qk_nope_head_dim + args.v_head_dim)
    attn.kv_b_proj = ColumnParallelLinear(args.kv_lora_rank, kv_out, tp)
    attn.o_proj = RowParallelLinear(args.num_attention_heads * args.v_head_dim, args.hidden_size, tp)
    layer.self_attn = attn
    if placement is not None and args.is_moe_layer(layer.layer_id):
        moe = ExpertParallelMoE(args, placement, mesh.ep, tp)
        if moe.shared_experts is not None:
            _shard_mlp(
                moe.shared_experts, args.hidden_size, args.n_shared_experts * args.moe_intermediate_size, tp
            )
        layer.mlp = moe
    else:
        _shard_mlp(layer.mlp, args.hidden_size, args.intermediate_size, tp)


def build_shard(
    args: ModelArgs, with_mtp: bool, mesh: ParallelMesh, placement: ExpertPlacement | None = None
) -> Transformer:
    """This rank's Transformer (on the current default device, normally meta)."""
    check_layout(args, mesh.shape.tp, mesh.shape.ep, mesh.shape.pp)
    if args.n_routed_experts and placement is None:
        placement = ExpertPlacement.contiguous(args.n_routed_experts, mesh.shape.ep)
    # Every FFN built dense first, then MoE layers get their expert-parallel share: building all of a
    # 671B model's routed experts only to drop them took seconds.
    model = Transformer(replace(args, n_routed_experts=0), with_mtp=with_mtp and mesh.is_last_stage)
    model.args = args
    stage_layers = assign_stages(args, mesh.shape.pp)[mesh.pp_index]
    for key in list(model.model.layers):
        if int(key) not in stage_layers:
            del model.model.layers[key]
    for layer in list(model.model.layers.values()) + list(model.mtp):
        _shard_layer(layer, args, mesh, placement)
    if mesh.is_first_stage:
        model.model.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, mesh.tp)
    else:
        del model.model.embed_tokens
    if mesh.is_last_stage:
        model.lm_head = VocabParallelHead(args.hidden_size, args.vocab_size, mesh.tp)
    else:
        del model.model.norm, model.lm_head
    return model


def load_shard(
    path: str,
    mesh: ParallelMesh,
    dtype: torch.dtype = torch.float32,
    fp8: str = "auto",
    with_mtp: bool = False,
    placement: ExpertPlacement | None = None,
    quantization: str = "none",
) -> Transformer:
    """Load only this rank's part of a checkpoint onto the mesh's device."""
    return load_model(
        path,
        dtype,
        mesh.device,
        fp8,
        with_mtp,
        build=lambda args, mtp: build_shard(args, mtp, mesh, placement),
        quantization=quantization,
    )
