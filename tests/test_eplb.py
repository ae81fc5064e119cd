"""EPLB placement (parallel/eplb.py): against exhaustive search on tiny cases, the hierarchical vs global
choice, balance on skewed loads against the contiguous placement, and the invariants every placement
must keep (every expert owned, equal slots per rank, no rank with two copies of one expert)."""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch

from moelaunch.measure.random_checkpoint import SHAPES
from moelaunch.model.config import args_from_hf_config
from moelaunch.model.expert_load import ExpertLoad
from moelaunch.model.expert_load_file import read_expert_load, write_expert_load
from moelaunch.model.moe import MoE
from moelaunch.model.transformer import Transformer
from moelaunch.parallel.eplb import _pack, balanced_placements, max_over_mean, rank_loads, uses_hierarchy
from moelaunch.parallel.expert_parallel import AllToAllDispatch, ExpertPlacement
from moelaunch.parallel.group import Group
from moelaunch.parallel.mesh import MeshShape, ParallelMesh
from moelaunch.parallel.parallelize import MeshShard


def zipf_load(n_layers: int, n_experts: int, seed: int = 0) -> torch.Tensor:
    """Token counts per expert falling as 1/rank, the busiest experts in a different order per layer."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, n_experts + 1, dtype=torch.float64)
    return torch.stack(
        [(weights[torch.randperm(n_experts, generator=g)] * 10_000).round() for _ in range(n_layers)]
    )


def best_max_rank_load(tokens: list[int], ep: int, redundant: int) -> float:
    """The lowest busiest-rank load of any placement with equal slots per rank (exhaustive search)."""
    n = len(tokens)
    slots = (n + redundant) // ep
    best = float("inf")
    for choice in itertools.product(itertools.combinations(range(n), slots), repeat=ep):
        copies = [sum(e in held for held in choice) for e in range(n)]
        if min(copies) == 0:
            continue
        best = min(best, max(sum(tokens[e] / copies[e] for e in held) for held in choice))
    return best


def check_invariants(placement: ExpertPlacement, n_experts: int, ep: int, redundant: int) -> None:
    assert placement.ep_size == ep and len(placement.owners) == n_experts
    assert all(ranks and len(set(ranks)) == len(ranks) for ranks in placement.owners)
    assert [len(placement.experts_of(r)) for r in range(ep)] == [(n_experts + redundant) // ep] * ep


# (n_experts, ep, redundant_experts) small enough to search every placement.
TINY_SIZES = [(4, 2, 0), (4, 2, 2), (6, 2, 0), (6, 2, 2), (6, 3, 0), (6, 3, 3), (4, 4, 4)]


def test_close_to_the_best_placement_on_tiny_cases():
    rng = random.Random(0)
    ratios = []
    for _ in range(150):
        n, ep, redundant = rng.choice(
            [(4, 2, 0), (4, 2, 2), (6, 2, 0), (6, 2, 2), (6, 3, 0), (6, 3, 3), (4, 4, 4)]
        )
        tokens = [rng.randint(0, 100) for _ in range(n)]
        placement = balanced_placements(torch.tensor([tokens]), ep, redundant, 1, 1)[0]
        check_invariants(placement, n, ep, redundant)
        best = best_max_rank_load(tokens, ep, redundant)
        ratios.append(rank_loads(torch.tensor(tokens), placement).max().item() / max(best, 1e-9))
    # Greedy replication and packing is a heuristic: never below the optimum, never far above it.
    assert min(ratios) >= 1 - 1e-9
    assert max(ratios) <= 4 / 3
    assert sum(ratios) / len(ratios) <= 1.05
    assert sum(r <= 1 + 1e-9 for r in ratios) >= len(ratios) // 3


def test_known_optimum():
    # Contiguous puts both busy experts on rank 0 (20 vs 2); the best is one busy, one idle expert each.
    load = torch.tensor([[10, 10, 1, 1]])
    placement = balanced_placements(load, 2, 0, 1, 1)[0]
    assert rank_loads(load[0], placement).tolist() == [11.0, 11.0]
    assert rank_loads(load[0], ExpertPlacement.contiguous(4, 2)).tolist() == [20.0, 2.0]
    # Two redundant slots: the two busiest experts get a copy on each rank, halving their loads.
    load = torch.tensor([[40, 10, 10, 20]])
    placement = balanced_placements(load, 2, 2, 1, 1)[0]
    assert placement.owners[0] == placement.owners[3] == (0, 1)
    assert rank_loads(load[0], placement).tolist() == [40.0, 40.0]


def test_hierarchical_when_nodes_divide_groups():
    assert uses_hierarchy(n_groups=4, n_nodes=2) and uses_hierarchy(8, 4)
    assert not uses_hierarchy(4, 3) and not uses_hierarchy(4, 1)
    load = zipf_load(3, 16, seed=1)
    # 4 groups of 4 experts on 2 nodes of 2 ranks: every copy of a group's experts stays on one node.
    for placement in balanced_placements(load, 4, 4, n_groups=4, n_nodes=2):
        check_invariants(placement, 16, 4, 4)
        for group in range(4):
            nodes = {r // 2 for e in range(4 * group, 4 * group + 4) for r in placement.owners[e]}
            assert len(nodes) == 1, placement.owners
    # 3 nodes do not divide 4 groups: the global policy, the same as one group on one node.
    assert balanced_placements(load, 6, 2, n_groups=4, n_nodes=3) == balanced_placements(load, 6, 2, 1, 1)
    # Grouping constrains the packing: the global policy balances at least as well here.
    hier = balanced_placements(load, 4, 4, 4, 2)
    flat = balanced_placements(load, 4, 4, 1, 1)
    for row, h, f in zip(load, hier, flat, strict=True):
        assert max_over_mean(row, f) <= max_over_mean(row, h) + 1e-9


@pytest.mark.parametrize("ep", [4, 8])
def test_better_than_contiguous_on_skewed_load(ep):
    load = zipf_load(4, 64)
    contiguous = ExpertPlacement.contiguous(64, ep)
    before = [max_over_mean(row, contiguous) for row in load]
    plain = [
        max_over_mean(row, p) for row, p in zip(load, balanced_placements(load, ep, 0, 8, 1), strict=True)
    ]
    copies = [
        max_over_mean(row, p) for row, p in zip(load, balanced_placements(load, ep, ep, 8, 1), strict=True)
    ]
    assert all(a < b for a, b in zip(plain, before, strict=True))
    # Copies split the busiest experts, which packing alone cannot: closer to 1 still.
    assert all(c < a for c, a in zip(copies, plain, strict=True))
    assert max(copies) < 1.01


def test_invariants_and_determinism_on_random_loads():
    rng = random.Random(1)
    for _ in range(40):
        ep, n_nodes = rng.choice([(2, 1), (4, 1), (4, 2), (8, 2), (8, 4)])
        n_experts = rng.choice([16, 32])
        redundant = ep * rng.randint(0, 2)
        counts = [[rng.choice([0, 1, 5, 50, 1000]) for _ in range(n_experts)] for _ in range(2)]
        load = torch.tensor(counts)
        placements = balanced_placements(load, ep, redundant, 4, n_nodes)
        assert len(placements) == 2
        for row, placement in zip(load, placements, strict=True):
            check_invariants(placement, n_experts, ep, redundant)
            assert rank_loads(row, placement).sum().item() == pytest.approx(row.sum().item())
        assert balanced_placements(load.float(), ep, redundant, 4, n_nodes) == placements


def test_pack_never_puts_two_copies_on_one_rank():
    # Heaviest first fills pack 1 with the three middle items; both copies of key 4 are left for pack 0,
    # so one trades places with an item of pack 1.
    packs = _pack([10, 3, 3, 2, 1, 1], [0, 1, 2, 3, 4, 4], 2)
    assert sorted(packs.count(p) for p in (0, 1)) == [3, 3]
    assert packs[4] != packs[5]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((8, 3, 0, 1, 1), "8 routed experts + 0 redundant = 8 slots do not split over ep=3"),
        ((8, 2, 10, 1, 1), "use at most 8 redundant experts"),
        ((8, 4, 0, 1, 3), "ep=4 ranks do not split over n_nodes=3"),
        ((8, 4, 12, 2, 2), "5 slots exceed the 4 experts of its node; use at most 8"),
        ((8, 2, -2, 1, 1), "redundant_experts >= 0"),
    ],
)
def test_sizes_that_do_not_fit_are_refused(args, message):
    n_experts, ep, redundant, groups, nodes = args
    with pytest.raises(ValueError, match=re.escape(message)):
        balanced_placements(torch.ones(1, n_experts), ep, redundant, groups, nodes)


def test_bad_load_is_refused():
    with pytest.raises(ValueError, match="n_moe_layers, n_routed_experts"):
        balanced_placements(torch.ones(8), 2, 0, 1, 1)
    with pytest.raises(ValueError, match="negative or non-finite"):
        balanced_placements(torch.tensor([[1.0, -1.0]]), 2, 0, 1, 1)


def test_each_layer_holds_its_own_placement():
    """MeshShard gives every MoE layer its own placement (the default where none is given): the experts
    a rank builds are the ones its layer's placement gives it, copies included."""
    args = args_from_hf_config({**SHAPES["tiny"], "num_hidden_layers": 4})  # MoE layers 1-3
    shape = MeshShape(tp=1, dp=4)
    load = zipf_load(2, args.n_routed_experts)
    per_layer = dict(zip((1, 2), balanced_placements(load, 4, 4, args.n_group, 1), strict=True))
    for rank in range(4):
        shard = MeshShard(args, ParallelMesh.planned(shape, rank), layer_placements=per_layer)
        with torch.device("meta"):
            model = Transformer(args, with_mtp=False, shard=shard)
        for layer in (1, 2):
            assert model.model.layers[str(layer)].mlp.local_ids == per_layer[layer].experts_of(rank)
        contiguous = ExpertPlacement.contiguous(args.n_routed_experts, 4)
        assert model.model.layers["3"].mlp.local_ids == contiguous.experts_of(rank)


class SummedByCaller(Group):
    """A group whose all-reduce leaves the sum to the test (ranks simulated one after another)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_copies_count_once_when_every_rank_routes_all_rows():
    """ep = tp (dp=1): every rank runs all rows through the experts it holds and the group sums; an
    expert held twice must still count once (the static decode step's path)."""
    torch.manual_seed(0)
    args = args_from_hf_config({**SHAPES["tiny"], "n_group": 1, "topk_group": 1})
    whole = MoE(args)
    with torch.no_grad():
        for p in whole.parameters():
            p.normal_(0, 0.2)
    whole.eval().requires_grad_(False)
    x = torch.randn(16, args.hidden_size)
    expected = whole(x)
    placement = ExpertPlacement.from_map([[0, 1], [0], [1], [0, 1], [0], [1], [0], [1]], 8, 2)
    total = torch.zeros_like(expected)
    for rank in (0, 1):
        group = SummedByCaller([0, 1], rank, None)
        part = MoE(args, AllToAllDispatch(placement, group, group))
        part.load_state_dict(whole.state_dict(), strict=False)
        part.eval().requires_grad_(False).stack_experts()
        total += part(x, static=True)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_expert_load_file_round_trip_with_layers_from_the_gates(tmp_path):
    """ExpertLoad.by_layer keys the gates' counts by decoder layer index (MTP: num_hidden_layers + k),
    as the expert-load file wants; what write_expert_load writes, read_expert_load reads back."""
    args = args_from_hf_config({**SHAPES["tiny"], "num_hidden_layers": 4, "num_nextn_predict_layers": 1})
    with torch.device("meta"):
        model = Transformer(args, with_mtp=True)
    load = ExpertLoad(model)
    for i, counts in enumerate(load.counts.values()):
        counts += torch.arange(8) * (i + 1)
    by_layer = load.by_layer()
    assert sorted(by_layer) == [1, 2, 3, 4]  # 0 is dense; 4 is the MTP layer
    assert by_layer[4].tolist() == load.counts["mtp.0.mlp.gate"].tolist()
    write_expert_load(tmp_path / "load.json", 123, by_layer)
    read = read_expert_load(tmp_path / "load.json", args)
    assert read.tokens == 123 and read.layers == (1, 2, 3, 4)
    assert torch.equal(read.counts, torch.stack([by_layer[i] for i in (1, 2, 3, 4)]))
