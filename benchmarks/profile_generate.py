"""Where a generate's time goes, op by op: torch.profiler over one `LLM.generate` of B random 64-token
prompts, 64 tokens out each, greedy, one thread, after a warm-up on the same prompts (which compiles the
batch's decode step under --compile on). Prints the plain and profiled wall times, then the ops by self
time, split by input shapes (the C++ kernels' calls per projection: routed experts, MLA decode, lm_head).

    python -m benchmarks.profile_generate /tmp/benchm512 --dtype bfloat16 --batch 64 --compile on
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moelaunch.launcher import LLM, SamplingParams

PROMPT_LEN, OUT_LEN = 64, 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--compile", choices=("auto", "on", "off"), default="on", help="engine.compile")
    p.add_argument("--quantization", choices=("none", "int8", "w8a8", "int4"), default="none")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--rows", type=int, default=25, help="ops to list")
    a = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        compile=a.compile,
        quantization=a.quantization,
        kv_cache_dtype=a.kv_cache_dtype,
    )
    vocab = llm.engine.model.args.vocab_size  # the bundled model has 103 token ids
    low, high = min(100, vocab // 2), min(1000, vocab)
    rng = random.Random(0)
    prompts = [[rng.randrange(low, high) for _ in range(PROMPT_LEN)] for _ in range(a.batch)]
    params = SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True)
    llm.generate(prompts, params)
    start = time.perf_counter()
    llm.generate(prompts, params)
    print(f"plain generate {time.perf_counter() - start:.3f} s")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        print(f"profiled generate {time.perf_counter() - start:.3f} s")
    table = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=50
    )
    print(table)
    llm.shutdown()


if __name__ == "__main__":
    main()
