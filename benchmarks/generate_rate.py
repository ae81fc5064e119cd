"""Out tokens per second of `LLM.generate` on random prompts, one process, one thread: B prompts of 64
random token ids, 64 tokens out each, greedy, ignore_eos; the median (min-max) of 3 timed runs after a
warm-up on the same prompts (which compiles the batch's decode step under --compile on). The prefix
cache holds the prompts by then, so the median is mostly decode (what the A/Bs it serves compare);
`launch bench` gives fresh prompts every round.
For A/Bs decided by the environment (e.g. MOELAUNCH_CPU_ISA=avx512 against the default), run it once
per setting, alternating:

    for r in 1 2 3; do MOELAUNCH_CPU_ISA=avx512 python -m benchmarks.generate_rate /tmp/benchm;
      python -m benchmarks.generate_rate /tmp/benchm; done
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from moelaunch.launcher import LLM, SamplingParams

PROMPT_LEN, OUT_LEN, RUNS = 64, 64, 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", default="8,64")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="engine.compile")
    p.add_argument("--quantization", choices=("none", "int8", "w8a8", "int4"), default="none")
    a = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM(model=a.model, dtype=a.dtype, compile=a.compile, quantization=a.quantization)
    vocab = llm.engine.model.args.vocab_size  # the bundled model has 103 token ids
    low, high = min(100, vocab // 2), min(1000, vocab)
    rng = random.Random(0)
    for batch in map(int, a.batch_sizes.split(",")):
        prompts = [[rng.randrange(low, high) for _ in range(PROMPT_LEN)] for _ in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        params = SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True)
        times = []
        for _ in range(RUNS):
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            times.append(time.perf_counter() - start)
        rate = [batch * OUT_LEN / t for t in (statistics.median(times), max(times), min(times))]
        first = outs[0].outputs[0].token_ids[:8]
        print(f"B={batch} tok/s {rate[0]:.1f} ({rate[1]:.1f}-{rate[2]:.1f}) first={first}")
    llm.shutdown()


if __name__ == "__main__":
    main()
