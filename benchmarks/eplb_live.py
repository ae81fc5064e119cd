"""Live expert load balancing on the bundled model: routed rows per EP rank, max/mean, without and with
the engine rebalancing itself (engine.eplb), on a skewed workload (one skill's prompts only).

    python -m benchmarks.eplb_live                          # dp=4 (ep 4), window = interval = 8 steps
    python -m benchmarks.eplb_live --kind sort --redundant-experts 4 --window 8

The engine reads the routed load summed over its ranks every `window` steps; at a rebalance step the read
comes first, so each window is measured under the placement that routed it, computed by EPLB from the
window before (the first window runs on the loaded, contiguous placement). Each window's same counts are
also put on the loaded placement: what it would have been without EPLB. Greedy decoding: the figures are
deterministic (the same tokens whatever the placement, tests/test_parallel_layouts.py).
"""

from __future__ import annotations

import argparse
import statistics

from moelaunch.engine.llm import LLM
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT
from moelaunch.model.config import load_args
from moelaunch.parallel.eplb import max_over_mean
from moelaunch.parallel.expert_parallel import ExpertPlacement
from moelaunch.tasks.problem_sets import held_out_sample


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--kind", default="sort", help="the one skill whose prompts make the workload")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--window", type=int, default=8, help="engine.eplb window and interval (steps)")
    p.add_argument("--redundant-experts", type=int, default=4)
    args = p.parse_args()
    eplb = {"window": args.window, "interval": args.window, "redundant_experts": args.redundant_experts}
    problems = [q for q in held_out_sample(1000) if q.kind == args.kind][: args.prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(args.model, dp=args.dp, eplb=eplb, max_num_seqs=args.prompts) as llm:
        engine = llm.engine
        for i, q in enumerate(problems):
            engine.add_request(str(i), llm.tokenizer.encode(q.prompt), params)
        loaded = ExpertPlacement.contiguous(load_args(args.model).n_routed_experts, args.dp)
        windows, seen = [], None
        while engine.has_unfinished():
            engine.step()
            report = engine.expert_load
            if report is not None and report.steps != seen and report.window_steps == args.window:
                seen = report.steps
                w = report.window
                without = statistics.mean(max_over_mean(w[i], loaded) for i in range(len(w)))
                with_eplb = statistics.mean(report.rank_imbalance(w).values())
                windows.append((report.steps, report.rebalances, without, with_eplb))
    print(f"{len(problems)} '{args.kind}' prompts, dp={args.dp}, eplb={eplb}")
    print("max/mean routed rows per EP rank, mean over the MoE layers, per window of steps")
    print(" step  rebalances  loaded placement  placement in force")
    for step, applied, without, with_eplb in windows:
        print(f"{step:>5}  {applied:>10}  {without:>16.2f}  {with_eplb:>18.2f}")
    later = windows[1:]  # the first window runs on the loaded placement
    print(
        f"windows 2-{len(windows)}: loaded placement {statistics.mean(w[2] for w in later):.2f}, "
        f"EPLB's {statistics.mean(w[3] for w in later):.2f} (each from the window before)"
    )


if __name__ == "__main__":
    main()
