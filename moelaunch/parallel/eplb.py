"""Expert placement from measured load, after DeepSeek's EPLB: the most-loaded experts get redundant
copies (each copy then takes an equal share of its expert's tokens), and the copies are packed onto
the EP ranks so that every rank holds the same number of expert slots and the busiest rank is as
light as the greedy packing can make it.

Hierarchical when the EP group's nodes divide the model's expert groups: whole expert groups go to
nodes first (group-limited routing then keeps most of a token's traffic inside a node), then each
node replicates and packs its own experts over its ranks. Otherwise one global step over all ranks.
EP rank r is on node r // (ep_size / n_nodes) (ranks are numbered node by node, mesh.py).

Everything is plain arithmetic on the CPU with ties broken by index, so every rank computes the same
placement from the same load.
"""

from __future__ import annotations

import torch

from moelaunch.parallel.expert_parallel import ExpertPlacement


def balanced_placements(
    load: torch.Tensor, ep_size: int, redundant_experts: int, n_groups: int, n_nodes: int
) -> list[ExpertPlacement]:
    """One placement per MoE layer (rows of `load`: [n_moe_layers, n_routed_experts] token counts),
    each rank holding (n_routed_experts + redundant_experts) / ep_size expert slots."""
    if load.dim() != 2 or load.shape[1] == 0:
        raise ValueError(
            f"expert load must be [n_moe_layers, n_routed_experts], got shape {list(load.shape)}"
        )
    n_experts = load.shape[1]
    rows = load.detach().to("cpu", torch.float64)
    if not torch.isfinite(rows).all() or (rows < 0).any():
        raise ValueError("expert load holds negative or non-finite counts: give token counts (>= 0)")
    hierarchical = _check_sizes(n_experts, ep_size, redundant_experts, n_groups, n_nodes)
    if not hierarchical:  # the global policy: one group on one node
        n_groups, n_nodes = 1, 1
    return [_place_layer(row.tolist(), ep_size, redundant_experts, n_groups, n_nodes) for row in rows]


def uses_hierarchy(n_groups: int, n_nodes: int) -> bool:
    """Whether balanced_placements places expert groups on nodes first (else: one global step)."""
    return n_nodes > 1 and n_groups % n_nodes == 0


def rank_loads(load_row: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """Tokens each EP rank receives under `placement` (the copies of an expert share its load evenly)."""
    out = torch.zeros(placement.ep_size, dtype=torch.float64)
    for tokens, ranks in zip(load_row.tolist(), placement.owners, strict=True):
        for r in ranks:
            out[r] += tokens / len(ranks)
    return out


def max_over_mean(load_row: torch.Tensor, placement: ExpertPlacement) -> float:
    """The busiest EP rank's tokens over the mean (1.0: perfect balance; the step waits on the busiest)."""
    return peak_ratio(rank_loads(load_row, placement))


def peak_ratio(per_rank: torch.Tensor) -> float:
    """max/mean of tokens per rank (1.0 when nothing is routed)."""
    mean = per_rank.mean().item()
    return per_rank.max().item() / mean if mean > 0 else 1.0


def _check_sizes(n_experts: int, ep_size: int, redundant: int, n_groups: int, n_nodes: int) -> bool:
    """Refuse sizes that cannot give every rank the same slot count; return whether to go hierarchical."""
    if ep_size < 1 or redundant < 0 or n_groups < 1 or n_nodes < 1:
        raise ValueError(
            f"ep_size={ep_size}, redundant_experts={redundant}, n_groups={n_groups}, n_nodes={n_nodes}: "
            "sizes must be >= 1 (redundant_experts >= 0)"
        )
    slots = n_experts + redundant
    if slots % ep_size:
        raise ValueError(
            f"{n_experts} routed experts + {redundant} redundant = {slots} slots do not split over "
            f"ep={ep_size} ranks: choose redundant_experts so that the sum is a multiple of {ep_size}"
        )
    # No rank holds two copies of one expert, so an expert has at most ep_size copies.
    if slots // ep_size > n_experts:
        raise ValueError(
            f"redundant_experts={redundant} gives each of ep={ep_size} ranks {slots // ep_size} slots, more "
            f"than the {n_experts} experts: use at most {n_experts * (ep_size - 1)} redundant experts"
        )
    if ep_size % n_nodes:
        raise ValueError(
            f"ep={ep_size} ranks do not split over n_nodes={n_nodes}: give the nodes the EP group spans"
        )
    if not uses_hierarchy(n_groups, n_nodes):
        return False
    if n_experts % n_groups:
        raise ValueError(f"{n_experts} routed experts do not split into n_groups={n_groups} expert groups")
    per_rank, ranks_per_node = slots // ep_size, ep_size // n_nodes
    if per_rank > n_experts // n_nodes:
        raise ValueError(
            f"redundant_experts={redundant}: each rank's {per_rank} slots exceed the "
            f"{n_experts // n_nodes} experts of its node; use at most "
            f"{n_experts * (ranks_per_node - 1)} redundant experts"
        )
    return True


def _place_layer(
    tokens: list[float], ep_size: int, redundant: int, n_groups: int, n_nodes: int
) -> ExpertPlacement:
    n_experts = len(tokens)
    group_size, ranks_per_node = n_experts // n_groups, ep_size // n_nodes
    slots_per_node = (n_experts + redundant) // n_nodes
    # Step 1: whole expert groups onto nodes, n_groups / n_nodes groups each.
    group_tokens = [sum(tokens[g * group_size : (g + 1) * group_size]) for g in range(n_groups)]
    node_of_group = _pack(group_tokens, list(range(n_groups)), n_nodes)
    owners: list[list[int]] = [[] for _ in range(n_experts)]
    for node in range(n_nodes):
        experts = [e for e in range(n_experts) if node_of_group[e // group_size] == node]
        # Step 2: copies of the node's busiest experts, up to its slot count.
        copies = _replicate([tokens[e] for e in experts], slots_per_node, ranks_per_node)
        # Step 3: the copies onto the node's ranks, each copy carrying an equal share of its expert.
        items = [i for i, c in enumerate(copies) for _ in range(c)]
        shares = [tokens[experts[i]] / copies[i] for i in items]
        for i, pack in zip(items, _pack(shares, items, ranks_per_node), strict=True):
            owners[experts[i]].append(node * ranks_per_node + pack)
    return ExpertPlacement(tuple(tuple(sorted(r)) for r in owners), ep_size)


def _replicate(tokens: list[float], n_slots: int, max_copies: int) -> list[int]:
    """Copies per expert filling n_slots: each extra copy goes to the expert whose copies carry the
    most tokens each (its share then drops most), never beyond max_copies."""
    copies = [1] * len(tokens)
    for _ in range(n_slots - len(tokens)):
        open_experts = [e for e in range(len(tokens)) if copies[e] < max_copies]
        busiest = max(open_experts, key=lambda e: (tokens[e] / copies[e], -e))
        copies[busiest] += 1
    return copies


def _pack(weights: list[float], keys: list[int], n_packs: int) -> list[int]:
    """Balanced packing: the pack of each item, every pack getting len(weights) / n_packs items and no
    pack two items of one key. Heaviest item first onto the lightest pack with room (ties: lowest
    index); where only packs already holding the key have room, a swap with another pack keeps the
    rule."""
    per_pack = len(weights) // n_packs
    pack_of = [-1] * len(weights)
    members: list[list[int]] = [[] for _ in range(n_packs)]
    totals = [0.0] * n_packs
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], keys[i], i)):
        open_packs = [p for p in range(n_packs) if len(members[p]) < per_pack]
        allowed = [p for p in open_packs if all(keys[j] != keys[i] for j in members[p])]
        if allowed:
            target = min(allowed, key=lambda p: (totals[p], p))
        else:
            target = min(open_packs, key=lambda p: (totals[p], p))
            i = _swap_out(i, target, weights, keys, members, totals, pack_of)
        pack_of[i] = target
        members[target].append(i)
        totals[target] += weights[i]
    return pack_of


def _swap_out(
    item: int,
    pack: int,
    weights: list[float],
    keys: list[int],
    members: list[list[int]],
    totals: list[float],
    pack_of: list[int],
) -> int:
    """`item` cannot join `pack` (which holds its key): move it to another pack in exchange for one of
    that pack's items whose key `pack` lacks, the closest in weight; return the item that joins `pack`.
    One exists: the item's key is in fewer packs than there are (at most n_packs copies), and a pack
    without it is full with distinct keys, more than `pack`'s other keys."""
    in_pack = {keys[j] for j in members[pack]}
    candidates = [
        (abs(weights[j] - weights[item]), q, j)
        for q in range(len(members))
        if q != pack and keys[item] not in {keys[m] for m in members[q]}
        for j in members[q]
        if keys[j] not in in_pack
    ]
    _, other_pack, other = min(candidates)
    members[other_pack].remove(other)
    members[other_pack].append(item)
    pack_of[item] = other_pack
    totals[other_pack] += weights[item] - weights[other]
    return other
