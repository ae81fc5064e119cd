"""Expert load balance before and after EPLB (parallel/eplb.py) on a skewed load: max/mean routed rows per
EP rank. Deterministic (no timing): the same figures on every machine.

    python -m benchmarks.eplb_balance [--model configs/models/deepseek-v3-671b.json] [--zipf 1.0]
        [--tokens 65536] [--seed 0] [--write-load FILE]
    python -m benchmarks.eplb_balance --bundled 200 [--write-load FILE]

--bundled N measures the load instead: the bundled model (checkpoints/small) answering the first N
held-out problems of its task family (greedy, as `launch eval` asks them), its gates' routed rows
counted by model/expert_load.py (MTP layer included).

The load: `tokens` x num_experts_per_tok routed rows per MoE layer, spread over the experts by a Zipf
law (the r-th busiest expert gets a share proportional to 1/r^s), the busiest experts in a different,
seeded order in every layer. "before" is the contiguous placement (E/ep experts per rank in id order),
"after" EPLB's with R redundant experts. Per layout: the worst layer's max/mean, and the step's
(summed over layers: each layer waits on its busiest rank) sum of max over sum of mean.
`--write-load FILE` writes the load as an expert-load file, for `launch plan --expert-load FILE`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moelaunch.measure.scoring import DEFAULT_CHECKPOINT, ask, open_engine
from moelaunch.model.config import ModelArgs, load_args
from moelaunch.model.expert_load import ExpertLoad
from moelaunch.model.expert_load_file import write_expert_load
from moelaunch.parallel.eplb import balanced_placements, peak_ratio, rank_loads, uses_hierarchy
from moelaunch.parallel.expert_parallel import ExpertPlacement
from moelaunch.tasks.problem_sets import held_out_sample

REPO = Path(__file__).resolve().parent.parent
# (ep, nodes the EP group spans): 8 devices a node, as on H100/H200 machines.
LAYOUTS = ((4, 1), (8, 1), (16, 2))


def zipf_load(args: ModelArgs, tokens: int, s: float, seed: int) -> dict[int, torch.Tensor]:
    """Routed rows per expert of each MoE layer (decoder layer index -> [n_routed_experts])."""
    g = torch.Generator().manual_seed(seed)
    n = args.n_routed_experts
    share = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** s
    rows = tokens * args.num_experts_per_tok * share / share.sum()
    layers = [i for i in range(args.num_hidden_layers) if args.is_moe_layer(i)]
    return {i: rows[torch.randperm(n, generator=g)].round().long() for i in layers}


def bundled_load(n: int, top_k: int) -> tuple[int, dict[int, torch.Tensor]]:
    """(tokens through the main layers, routed rows per expert of each MoE layer) of the bundled model
    answering n held-out problems."""
    llm = open_engine(DEFAULT_CHECKPOINT)
    try:
        with ExpertLoad(llm.engine.model) as load:
            ask(llm, [(p,) for p in held_out_sample(n)])
    finally:
        llm.shutdown()
    counts = load.by_layer()
    return int(counts[min(counts)].sum()) // top_k, counts


def step_ratios(load: torch.Tensor, placements: list[ExpertPlacement]) -> tuple[float, float]:
    """(worst layer's max/mean, sum over layers of max / sum of mean) of routed rows per EP rank."""
    per_rank = [rank_loads(row, p) for row, p in zip(load, placements, strict=True)]
    step = sum(r.max().item() for r in per_rank) / sum(r.mean().item() for r in per_rank)
    return max(peak_ratio(r) for r in per_rank), step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "configs/models/deepseek-v3-671b.json"))
    parser.add_argument("--zipf", type=float, default=1.0, help="skew s: share of the r-th expert ~ 1/r^s")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bundled", type=int, metavar="N", help="measure the bundled model on N problems")
    parser.add_argument("--write-load", type=Path, help="also write the load as an expert-load file")
    a = parser.parse_args()
    if a.bundled:
        args = load_args(DEFAULT_CHECKPOINT)
        tokens, counts = bundled_load(a.bundled, args.num_experts_per_tok)
        source = f"measured: {a.bundled} held-out problems, {tokens} tokens"
    else:
        args, tokens = load_args(a.model), a.tokens
        counts = zipf_load(args, tokens, a.zipf, a.seed)
        source = f"Zipf s={a.zipf}, {tokens} tokens, seed {a.seed}"
    if a.write_load:
        write_expert_load(a.write_load, tokens, counts)
    load = torch.stack([counts[i] for i in sorted(counts)])
    n, model = args.n_routed_experts, DEFAULT_CHECKPOINT if a.bundled else a.model
    print(
        f"{model}: {n} routed experts, top-{args.num_experts_per_tok}, n_group {args.n_group}, "
        f"{len(counts)} MoE layers; {source}"
    )
    print("| ep | nodes | policy | redundant | worst layer before | after | step before | after |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for ep, nodes in [(ep, nodes) for ep, nodes in LAYOUTS if n % ep == 0]:  # contiguous needs ep | E
        before = step_ratios(load, [ExpertPlacement.contiguous(n, ep)] * len(load))
        policy = "hierarchical" if uses_hierarchy(args.n_group, nodes) else "global"
        for redundant in (0, ep, 4 * ep):
            after = step_ratios(load, balanced_placements(load, ep, redundant, args.n_group, nodes))
            print(
                f"| {ep} | {nodes} | {policy} | {redundant} | {before[0]:.3f} | {after[0]:.3f} | "
                f"{before[1]:.3f} | {after[1]:.3f} |"
            )


if __name__ == "__main__":
    main()
