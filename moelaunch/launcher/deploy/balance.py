"""`launch plan --expert-load FILE`: EPLB placements for a deployment from measured expert load, and the
balance they give: max/mean routed rows per EP rank in each MoE layer under the deployment's current
placement (before) and EPLB's (after). A step waits on each layer's busiest rank, so 1.0 is the ideal."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moelaunch.launcher.deploy.plan import LaunchPlan
from moelaunch.model.expert_load_file import ExpertLoadFile, read_expert_load
from moelaunch.parallel.eplb import balanced_placements, peak_ratio, rank_loads, uses_hierarchy
from moelaunch.parallel.expert_parallel import ExpertPlacement


@dataclass(frozen=True)
class Rebalance:
    load: ExpertLoadFile
    redundant_experts: int
    n_nodes: int  # nodes one EP group spans
    placements: dict[int, ExpertPlacement]  # decoder layer index -> EPLB's placement
    before: dict[int, torch.Tensor]  # decoder layer index -> routed rows per EP rank, current placement
    after: dict[int, torch.Tensor]  # the same under EPLB's placement


def rebalance(plan: LaunchPlan, load_path: Path, redundant_experts: int) -> Rebalance:
    """EPLB's placement for each layer of the load file, with routed rows per EP rank before and after;
    ValueError with the fix when the file or the sizes do not fit the deployment."""
    args, ep = plan.args, plan.mesh.ep
    load = read_expert_load(load_path, args)
    per_node = plan.config.cluster.devices_per_node
    # An EP group is a stage's contiguous ranks: whole nodes when it is a multiple of a node, else one.
    n_nodes = ep // per_node if ep % per_node == 0 else 1
    try:
        found = balanced_placements(load.counts, ep, redundant_experts, args.n_group, n_nodes)
    except ValueError as e:
        raise ValueError(f"--redundant-experts {redundant_experts} with ep = dp*tp = {ep}: {e}") from None
    placements = dict(zip(load.layers, found, strict=True))
    before, after = {}, {}
    for layer, row in zip(load.layers, load.counts, strict=True):
        before[layer] = rank_loads(row, plan.placement_of(layer))
        after[layer] = rank_loads(row, placements[layer])
    return Rebalance(load, redundant_experts, n_nodes, placements, before, after)


def format_rebalance(plan: LaunchPlan, r: Rebalance, source: Path) -> str:
    args, ep = plan.args, plan.mesh.ep
    if uses_hierarchy(args.n_group, r.n_nodes):
        policy = f"hierarchical: {args.n_group} expert groups over {r.n_nodes} nodes"
    elif r.n_nodes == 1:
        policy = "global (the EP group is on one node)"
    else:
        policy = (
            f"global (the EP group's {r.n_nodes} nodes do not divide n_group {args.n_group} expert groups)"
        )
    slots = (args.n_routed_experts + r.redundant_experts) // ep
    lines = [
        f"Expert load balance (EPLB) for {plan.config.source} from {source}",
        f"  measured {r.load.tokens} tokens over {len(r.load.layers)} MoE layers; ep = dp*tp = {ep}; "
        f"{args.n_routed_experts} routed + {r.redundant_experts} redundant experts = {slots} per EP rank; "
        f"{policy}",
        "  routed rows per EP rank, max/mean (1.00 = even; each layer waits on its busiest rank)",
        "    layer  before  after  copied experts",
    ]
    for layer in r.load.layers:
        copied = sum(len(owners) > 1 for owners in r.placements[layer].owners)
        lines.append(
            f"    {layer:>5}  {peak_ratio(r.before[layer]):6.2f}  {peak_ratio(r.after[layer]):5.2f}  "
            f"{copied:>14}"
        )
    # Over a whole step: each layer's busiest rank, summed, against the mean's sum (the same either way).
    mean = sum(rows.mean().item() for rows in r.after.values())
    if mean > 0:
        before, after = (sum(rows.max().item() for rows in d.values()) / mean for d in (r.before, r.after))
        lines.append(f"      all  {before:6.2f}  {after:5.2f}  (sum over layers of max / of mean)")
    return "\n".join(lines)
