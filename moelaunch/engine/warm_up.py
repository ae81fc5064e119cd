"""Compiling the static decode step before traffic: one decode step per batch bucket and variant.

Under engine.compile: on, a bucket's step compiles the first time a batch of its size decodes: 6-17 s
on the CPU (then cached on disk, ~1.5 s a bucket in a later process), during which every running request
waits. A server runs these steps before it takes requests, as vLLM compiles before it serves. Greedy
and sampled steps are two graphs each; the steps of requests asking for log-probabilities or per-row
controls (penalties, bans) are rarer and still compile on first use.
"""

from __future__ import annotations

import time

from moelaunch.engine.config import EngineConfig
from moelaunch.engine.drive import Request, drive
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.engine.static_decode import bucket_sizes

# A one-token prompt and two tokens out: one prompt step, then one decode step of the bucket's size.
_WARM_UP_PROMPT = [0]
_VARIANTS = {
    "greedy": SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
    "sampled": SamplingParams(temperature=1.0, top_k=2, seed=0, max_tokens=2, ignore_eos=True),
}


def warm_up_decode(engine, config: EngineConfig, replicas: int = 1) -> tuple[list[int], float]:
    """Run a greedy and a sampled decode step at every bucket size through `engine` (an LLMEngine or a
    client with its methods), each replica's batch full; returns the sizes and the seconds it took."""
    started = time.monotonic()
    sizes = bucket_sizes(config.max_num_seqs, config.cuda_graph_sizes)
    for size in sizes:
        for variant, params in _VARIANTS.items():
            count = size * replicas
            requests = [
                Request(f"warm-up-{variant}-{size}-{i}", _WARM_UP_PROMPT, params) for i in range(count)
            ]
            for _ in drive(engine, requests):
                pass
    return sizes, time.monotonic() - started
