"""MTP speculative decoding against plain decoding: plain, MTP drafting every step (always) and the
draft policy (auto), side by side in one process, on one thread.

    python -m benchmarks.mtp_policy MODEL [--batches 1,8] [--rounds 3] [--requests 24] [--random-prompts]

Each batch size B runs `requests` requests with at most B at once (max_num_seqs=B, continuous
batching), greedy: the task family's held-out questions (answers end at EOS) or, with
--random-prompts, random 32-token prompts with 64 tokens out. The three engines take turns, `rounds`
times; the auto engine keeps what it measured from round to round, as a server would. Prints tok/s
(generated tokens / wall time) median and min-max per engine and batch, the drafts' acceptance, and
the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moelaunch.engine.llm import LLM
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.tasks.problem_sets import held_out_sample, messages

ENGINES = {"plain": {}, "mtp always": {"speculative_policy": "always"}, "mtp auto": {}}


def _prompts(llm: LLM, n: int, random_prompts: bool) -> tuple[list[list[int]], SamplingParams]:
    if random_prompts:
        g = torch.Generator().manual_seed(1)
        vocab = llm.engine.model.args.vocab_size
        prompts = [torch.randint(2, vocab, (32,), generator=g).tolist() for _ in range(n)]
        return prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [llm.tokenizer.encode_chat(messages((p,))) for p in held_out_sample(n)]
    return prompts, SamplingParams(temperature=0, max_tokens=96)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--random-prompts", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine: two threads wait on each other
    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    for batch in [int(b) for b in a.batches.split(",")]:
        llms = {
            name: LLM(
                a.model,
                kv_cache_memory=64 * 2**20,
                max_model_len=512,
                max_num_seqs=batch,
                **({"speculative": "mtp", **options} if name != "plain" else {}),
            )
            for name, options in ENGINES.items()
        }
        rates: dict[str, list[float]] = {name: [] for name in llms}
        for _ in range(a.rounds):
            for name, llm in llms.items():
                prompts, params = _prompts(llm, a.requests, a.random_prompts)
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                rates[name].append(tokens / (time.perf_counter() - start))
        for name, llm in llms.items():
            r, acceptance = rates[name], llm.engine.stats.spec_acceptance
            print(
                f"batch {batch:2d} {name:10s}: {statistics.median(r):7.1f} tok/s ({min(r):.1f}-{max(r):.1f})"
                f"  acceptance {'-' if acceptance is None else f'{acceptance:.3f}'}"
                f"  vs plain {statistics.median(r) / statistics.median(rates['plain']):.2f}x"
            )
            llm.shutdown()
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
