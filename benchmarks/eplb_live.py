"""Live expert load balancing on the bundled model: routed rows per EP rank, max/mean, before and after
the engine rebalances itself (engine.eplb), on a skewed workload (one skill's prompts only).

    python -m benchmarks.eplb_live                          # dp=4 (ep 4), window = interval = 8 steps
    python -m benchmarks.eplb_live --kind sort --redundant-experts 4 --window 8

The engine reads the routed load summed over its ranks every `window` steps; at a rebalance step the read
comes first, so each window is measured under the placement that routed it: the first under the
loaded (contiguous) placement, the later ones under the placements EPLB computed. Greedy decoding: the
figures are deterministic (the same tokens whatever the placement, tests/test_parallel_layouts.py).
Prints each window's max/mean per MoE layer, then the first window against the mean of the later ones.
"""

from __future__ import annotations

import argparse
import statistics

from moelaunch.engine.llm import LLM
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT
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
        windows, seen = [], None
        while engine.has_unfinished():
            engine.step()
            report = engine.expert_load
            if report is not None and report.steps != seen and report.window_steps == args.window:
                seen = report.steps
                windows.append((report.steps, report.rank_imbalance(report.window), report.rebalances))
    print(f"{len(problems)} '{args.kind}' prompts, dp={args.dp}, eplb={eplb}")
    print("step  placements applied before the window  max/mean routed rows per EP rank, per layer")
    for step, ratios, applied in windows:
        cells = "  ".join(f"L{layer} {r:.2f}" for layer, r in ratios.items())
        print(f"{step:>4}  {applied:>2}  {cells}  (mean {statistics.mean(ratios.values()):.2f})")
    first = statistics.mean(windows[0][1].values())
    later = [statistics.mean(r.values()) for _, r, _ in windows[1:]]
    print(f"before (first window, loaded placement): {first:.2f}")
    print(f"after (windows 2-{len(windows)}, EPLB placements): mean {statistics.mean(later):.2f}, "
          f"range {min(later):.2f}-{max(later):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
