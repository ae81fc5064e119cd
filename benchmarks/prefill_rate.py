"""Prompt steps alone: the time of `LLM.generate` on B fresh prompts of random token ids with one token
out, one process, one thread, max_num_batched_tokens 2048 (B x length up to it: one prompt step). Every
run draws new prompts, so the prefix cache never hits; the median (min-max) of the timed runs after
three warm-ups, in ms and prompt tokens per second, plus the process's page faults per run. For A/Bs
against an earlier commit, run it alternately from a worktree of that commit (`python -m` imports the
current directory's moelaunch first):

    git worktree add /tmp/base <commit> && cp benchmarks/prefill_rate.py /tmp/base/benchmarks/
    for r in 1 2 3; do (cd /tmp/base && python -m benchmarks.prefill_rate /tmp/benchm);
      python -m benchmarks.prefill_rate /tmp/benchm; done
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

import torch

from moelaunch.launcher import LLM, SamplingParams

WARM_UPS = 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM(model=a.model, dtype=a.dtype, max_num_batched_tokens=2048)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times, faults = [], []
    for run in range(WARM_UPS + a.runs):
        prompts = [[rng.randrange(100, 1000) for _ in range(a.prompt_len)] for _ in range(a.batch)]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        llm.generate(prompts, params)
        if run >= WARM_UPS:
            times.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    tokens = a.batch * a.prompt_len
    ms = [1e3 * t for t in (statistics.median(times), min(times), max(times))]
    print(
        f"{a.dtype} {a.batch} x {a.prompt_len} tokens: {ms[0]:.1f} ms ({ms[1]:.1f}-{ms[2]:.1f}), "
        f"{tokens / statistics.median(times):.0f} tok/s, page faults per run {statistics.median(faults):.0f}"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
