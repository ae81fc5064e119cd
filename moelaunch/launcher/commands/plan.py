"""`launch plan [CONFIG.yaml] [--set key.path=value ...] [--json]`: print where every rank runs, its
groups, layers, experts and memory, with the memory arithmetic spelled out; starts nothing.
`--expert-load FILE [--redundant-experts N] [--write-placement OUT.json]`: instead, EPLB's placement from
measured expert load and the balance before and after (deploy/balance.py)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from moelaunch.launcher.commands import add_deployment_arguments, count_or_zero
from moelaunch.launcher.deploy.balance import format_rebalance, rebalance
from moelaunch.launcher.deploy.config import disaggregated_parts, load_deploy_config
from moelaunch.launcher.deploy.plan import (
    ACTIVATION_BUFFERS,
    GB,
    LATENT_BUFFERS,
    MB,
    LaunchPlan,
    RankPlan,
    blocks_per_sequence,
    build_plan,
    kv_share_of_left,
    latent_segment,
    size_text,
)
from moelaunch.launcher.deploy.weights import (
    WeightPart,
    int4_groups,
    is_fp8,
    param_bytes,
    scale_blocks,
    tensor_bytes,
)
from moelaunch.model.quantization import is_quantizable
from moelaunch.parallel.mesh import LayoutError
from moelaunch.parallel.placement_file import write_placement_file
from moelaunch.parallel.shard_tensors import ShardTensor


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="print a deployment's ranks, groups, experts, layers and memory per device; starts nothing",
    )
    add_deployment_arguments(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.add_argument(
        "--expert-load",
        type=Path,
        metavar="FILE",
        help="measured expert load (launch eval --expert-load-out): print EPLB's placement's balance",
    )
    p.add_argument(
        "--redundant-experts",
        type=count_or_zero,
        default=0,
        metavar="N",
        help="with --expert-load: extra copies of the busiest experts, N a multiple of ep (default 0)",
    )
    p.add_argument(
        "--write-placement",
        type=Path,
        metavar="OUT.json",
        help="with --expert-load: write the placement, for parallel.expert_placement_file",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.expert_load is None and (args.write_placement or args.redundant_experts):
        raise ValueError("--redundant-experts and --write-placement need --expert-load FILE (measured load)")
    cfg = load_deploy_config(args.config, args.overrides)
    if cfg.disaggregation is None:
        plans = {"": build_plan(cfg)}
    else:  # each part's instances run on their own ranks: one plan per part
        plans = {role: build_plan(part) for role, part in disaggregated_parts(cfg).items()}
    if args.expert_load is not None:
        if cfg.disaggregation is not None:
            raise ValueError("--expert-load balances one layout: give a deployment without disaggregation")
        return run_rebalance(plans[""], args)
    if args.json:
        shown = {role: plan_json(plan) for role, plan in plans.items()}
        print(json.dumps(shown.get("", shown)))
    for role, plan in plans.items():
        if not args.json:
            if role:
                replicas = getattr(cfg.disaggregation, role).replicas
                print(f"== {role} part: {replicas} instance(s), each planned as follows")
            print(format_plan(plan))
        if not plan.fits:
            raise LayoutError(f"{role} part: {plan.verdict()}" if role else plan.verdict())
    return 0


def run_rebalance(plan: LaunchPlan, args: argparse.Namespace) -> int:
    if args.json:
        raise ValueError(
            "--json prints the plan; with --expert-load leave it out (--write-placement writes JSON)"
        )
    found = rebalance(plan, args.expert_load, args.redundant_experts)
    print(format_rebalance(plan, found, args.expert_load))
    if args.write_placement is not None:
        write_placement_file(args.write_placement, found.placements, args.redundant_experts)
        out = args.write_placement
        print(f"wrote {out}: deploy it with parallel.expert_placement_file: {out}")
    return 0


def format_plan(plan: LaunchPlan) -> str:
    return "\n\n".join([_summary(plan), _rank_table(plan), _stages_and_groups(plan), _memory_by_hand(plan)])


def _summary(plan: LaunchPlan) -> str:
    cfg, a, m = plan.config, plan.args, plan.mesh
    c, e = cfg.cluster, cfg.engine
    n_moe = sum(a.is_moe_layer(i) for i in range(a.num_hidden_layers))
    experts = (
        f"; routed experts per EP rank = {a.n_routed_experts}/{m.ep} = {a.n_routed_experts // m.ep}"
        if a.n_routed_experts and cfg.parallel.expert_placement is None
        else ""
    )
    if plan.layer_placements:
        experts += (
            f"; {len(plan.layer_placements)} MoE layers placed by {cfg.parallel.expert_placement_file} "
            f"({_slots(plan)} expert slots per EP rank, copies included)"
        )
    job = ", ".join(f"{k} {v}" for k, v in cfg.job.model_dump().items() if k != "mode")
    lines = [
        f"Launch plan for {cfg.source} (nothing started)",
        f"  model    {cfg.model}",
        f"           {a.num_hidden_layers} layers ({a.num_hidden_layers - n_moe} dense, {n_moe} MoE), "
        f"{a.num_attention_heads} heads, hidden {a.hidden_size}, {a.n_routed_experts} routed + "
        f"{a.n_shared_experts} shared experts, vocab {a.vocab_size}",
        f"  dtype    {plan.dtype}{' (from auto)' if cfg.dtype == 'auto' else ''}: {_dtype_note(plan)}",
        f"  cluster  {c.backend}: {c.nodes} node(s) x {c.devices_per_node} {plan.device} device(s) of "
        f"{size_text(plan.device_bytes)} ({size_text(plan.usable_bytes)} usable at memory_fraction "
        f"{c.memory_fraction})",
        f"  layout   tp {m.tp} x dp {m.dp} x pp {m.pp} = {m.world} ranks; ep = dp*tp = {m.ep}{experts}",
        f"  engine   max_model_len {plan.max_model_len}, max_num_seqs {e.max_num_seqs} per DP replica, "
        f"max_num_batched_tokens {e.max_num_batched_tokens}",
        f"  job      {cfg.job.mode}: {job}",
        f"  verdict  {plan.verdict() if plan.fits else 'DOES NOT FIT (see the end)'}",
    ]
    return "\n".join(lines)


def _dtype_note(plan: LaunchPlan) -> str:
    if plan.dtype == "fp8":
        b = plan.block
        return (
            f"projections 1 B/param + one fp32 scale (4 B) per {b[0]}x{b[1]} block; embedding, lm_head, "
            "norms, gate 2 B; KV cache and activations 2 B"
        )
    if plan.dtype == "bfloat16":
        return "weights, KV cache and activations 2 B per value (router bias 4 B)"
    return "weights, KV cache and activations 4 B per value"


def _unit(plan: LaunchPlan) -> tuple[int, str]:
    """GB for real models, MB when every rank needs less than 1 GB."""
    return (GB, "GB") if plan.heaviest.total_bytes >= GB else (MB, "MB")


def _rank_table(plan: LaunchPlan) -> str:
    unit, unit_name = _unit(plan)
    head = (
        "rank",
        "node",
        "device",
        "pp",
        "dp",
        "tp",
        "ep",
        "layers",
        "experts",
        "weights",
        "KV",
        "act",
        "total",
    )
    rows = [
        (
            r.rank,
            r.node,
            r.local_device,
            r.pp,
            r.dp,
            r.tp,
            r.ep,
            _ranges(r.layers),
            _experts_cell(r),
            f"{r.weight_bytes / unit:.2f}",
            f"{r.kv_cache_bytes / unit:.2f}",
            f"{r.activation_bytes / unit:.2f}",
            f"{r.total_bytes / unit:.2f}",
        )
        for r in plan.ranks
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    lines = [f"Ranks (memory in {unit_name}; 1 GB = 1e9 B, 1 MB = 1e6 B)"]
    for row in (head, *rows):
        lines.append("  " + "  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def _stages_and_groups(plan: LaunchPlan) -> str:
    a = plan.args
    lines = ["Stages"]
    for i, layers in enumerate(plan.stages):
        n_moe = sum(a.is_moe_layer(j) for j in layers)
        extra = (" + embedding" if i == 0 else "") + (
            " + final norm, lm_head" if i == len(plan.stages) - 1 else ""
        )
        lines.append(
            f"  stage {i}: layers {_ranges(layers)} ({len(layers)} layers: {len(layers) - n_moe} dense, "
            f"{n_moe} MoE){extra}"
        )
    groups = plan.groups()
    lines += [
        "",
        "Groups",
        f"  TP (heads, dense MLP, shared experts, vocab):  {_group_list(groups['tp'])}",
        f"  DP replicas (own requests and KV cache):       {_group_list(groups['dp_replica'])}",
        f"  EP, one per stage (routed experts, all-to-all): {_group_list(groups['ep'])}",
        f"  PP (hidden states between stages):             "
        f"{_group_list(groups['pp']) if plan.mesh.pp > 1 else 'none (pp 1)'}",
    ]
    return "\n".join(lines)


def _memory_by_hand(plan: LaunchPlan) -> str:
    r = plan.heaviest
    lines = [f"Memory of rank {r.rank} (the heaviest), by hand"]
    width = max(len(t.name) for part in r.weight_parts for t in part.tensors)
    for part in r.weight_parts:
        unit = part.unit_bytes(plan.dtype, plan.block, plan.quant)
        lines.append(
            f"  {part.name}: {part.count_note} = {part.count} x {unit:,} B = "
            f"{part.nbytes(plan.dtype, plan.block, plan.quant):,} B"
        )
        lines += [f"      {_tensor_line(t, plan, width)}" for t in part.tensors]
    a, e, v = plan.args, plan.config.engine, plan.value_bytes
    fraction = plan.config.cluster.memory_fraction
    unit, unit_name = _unit(plan)
    lines += [
        f"  weights total: {r.weight_bytes:,} B = {size_text(r.weight_bytes)}",
        f"  KV cache: {r.kv_blocks:,} blocks x {r.kv_block_bytes:,} B (block_size {e.block_size} tokens x "
        f"(kv_lora_rank {a.kv_lora_rank} + qk_rope_head_dim {a.qk_rope_head_dim}) x {v} B x {len(r.layers)} "
        f"layers) = {r.kv_cache_bytes:,} B = {size_text(r.kv_cache_bytes)}: {_kv_reason(plan, r)}",
        f"  activations: (max_num_batched_tokens {e.max_num_batched_tokens} x hidden {a.hidden_size} x "
        f"{ACTIVATION_BUFFERS} buffers + ({LATENT_BUFFERS} x {e.max_num_batched_tokens} step tokens + 2 x "
        f"{latent_segment(plan.max_model_len)} segment keys) x latent "
        f"{a.kv_lora_rank + a.qk_rope_head_dim}) x {v} B = {r.activation_bytes:,} B = "
        f"{size_text(r.activation_bytes)}",
        f"  total: {r.weight_bytes / unit:.2f} + {r.kv_cache_bytes / unit:.2f} + "
        f"{r.activation_bytes / unit:.2f} = {r.total_bytes / unit:.2f} {unit_name}; usable "
        f"{plan.device_bytes / GB:.2f} GB x {fraction} = {size_text(plan.usable_bytes)}: "
        f"{'fits' if plan.fits else 'DOES NOT FIT'}",
    ]
    return "\n".join(lines)


def _kv_reason(plan: LaunchPlan, r: RankPlan) -> str:
    e = plan.config.engine
    per_sequence = blocks_per_sequence(plan.max_model_len, e.block_size)
    if r.kv_blocks == e.max_num_seqs * per_sequence:
        return f"the most it can use, max_num_seqs {e.max_num_seqs} x {per_sequence} blocks of max_model_len"
    if r.kv_blocks == per_sequence:
        return "one sequence of max_model_len, the least that runs"
    share = kv_share_of_left(plan.config, plan.device)
    left = "what the weights and activations leave"
    if share is None:
        source = "engine.kv_cache_memory"
    else:
        source = left if share == 1 else f"{share:g} of {left}"
    return f"{source}: {r.kv_blocks / per_sequence:.1f} sequences of max_model_len"


def _tensor_line(t: ShardTensor, plan: LaunchPlan, width: int) -> str:
    dims = " x ".join(
        f"{n}/{t.tp}" if i == t.split_dim and t.tp > 1 else str(n) for i, n in enumerate(t.full_shape)
    )
    q = plan.quant
    if q is not None and is_quantizable(t.name, t.shape):
        rows, cols = t.shape
        if q.method == "int4":
            groups = int4_groups(t, q)
            text = (
                f"{t.name:<{width}} [{dims}] = {rows * cols:,} x 0.5 B (int4) + {rows} x {groups} x (4 + 1) B"
            )
        else:
            text = f"{t.name:<{width}} [{dims}] = {rows * cols:,} x 1 B ({q.method}) + {rows} scales x 4 B"
        return f"{text} = {tensor_bytes(t, plan.dtype, plan.block, q):,} B"
    text = f"{t.name:<{width}} [{dims}] = {math.prod(t.shape):,} x {param_bytes(t, plan.dtype)} B"
    if is_fp8(t, plan.dtype):
        rows, cols = scale_blocks(t, plan.block)
        text += f" + {rows} x {cols} scales x 4 B"
    return f"{text} = {tensor_bytes(t, plan.dtype, plan.block):,} B"


def plan_json(plan: LaunchPlan) -> dict[str, Any]:
    cfg, m = plan.config, plan.mesh
    return {
        "config": cfg.source,
        "model": cfg.model,
        "dtype": plan.dtype,
        "quantization": plan.quant.method if plan.quant else "none",
        "device": plan.device,
        "nodes": cfg.cluster.nodes,
        "devices_per_node": cfg.cluster.devices_per_node,
        "tp": m.tp,
        "dp": m.dp,
        "pp": m.pp,
        "ep": m.ep,
        "world": m.world,
        "device_bytes": plan.device_bytes,
        "usable_bytes": plan.usable_bytes,
        "fits": plan.fits,
        "verdict": plan.verdict(),
        "stages": plan.stages,
        "groups": plan.groups(),
        "ranks": [_rank_json(r, plan) for r in plan.ranks],
    }


def _rank_json(r: RankPlan, plan: LaunchPlan) -> dict[str, Any]:
    def part_json(part: WeightPart) -> dict[str, Any]:
        return {
            "name": part.name,
            "count": part.count,
            "bytes": part.nbytes(plan.dtype, plan.block, plan.quant),
        }

    return {
        "rank": r.rank,
        "node": r.node,
        "local_device": r.local_device,
        "pp": r.pp,
        "dp": r.dp,
        "tp": r.tp,
        "ep": r.ep,
        "layers": list(r.layers),
        "experts": list(r.experts),
        "layer_experts": {str(i): list(e) for i, e in r.layer_experts.items()},
        "weight_parts": [part_json(p) for p in r.weight_parts],
        "weight_bytes": r.weight_bytes,
        "kv_cache_bytes": r.kv_cache_bytes,
        "activation_bytes": r.activation_bytes,
        "total_bytes": r.total_bytes,
    }


def _experts_cell(r: RankPlan) -> str:
    """Its experts, or under a placement file the number it holds per MoE layer (they differ by layer)."""
    if not r.layer_experts:
        return _ranges(r.experts) or "-"
    counts = sorted({len(e) for e in r.layer_experts.values()})
    return f"{_ranges(counts)}/layer (file)"


def _slots(plan: LaunchPlan) -> str:
    counts = sorted(
        {len(p.experts_of(ep)) for p in plan.layer_placements.values() for ep in range(plan.mesh.ep)}
    )
    return _ranges(counts)


def _ranges(ids: tuple[int, ...] | list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _group_list(groups: list[list[int]]) -> str:
    shown = " ".join(f"[{_ranges(g)}]" for g in groups[:8])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > 8 else "")
