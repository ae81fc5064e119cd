"""One method of `launch report`, measured in a process of its own (so its peak memory is its own):
`python -m moelaunch.measure.report.measure SPEC_JSON` prints the entry as JSON on its last line.

Every method runs with the engine's defaults (as `launch` runs a checkpoint) plus its own options, and
the same KV cache budget, so the methods differ only in the method. Accuracy is scored as `launch eval`
scores it (`bundled.scoring`).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from moelaunch import kernels
from moelaunch.engine.llm import LLM
from moelaunch.engine.memory import peak_rss_bytes, rss_bytes
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.measure.report.probes import ANSWER_TOKENS, Probes, baseline_probes, compare, probe_prompts
from moelaunch.measure.scoring import GREEDY, accuracy, ask
from moelaunch.model.config import load_args
from moelaunch.tasks.capabilities import is_task_family
from moelaunch.tasks.problem_sets import held_out_sample

ENTRY_PREFIX = "report-entry: "
# Timed runs of each measurement: the median is reported, with the min-max beside it (a busy machine
# moves single samples by 2x or more).
TIMED_RUNS = 3
# Room for a task-family question (the held-out ones are at most 52 tokens) and its longest answer.
TASK_FAMILY_MAX_LEN = 64 + GREEDY.max_tokens


@dataclass(frozen=True)
class Workload:
    input_len: int = 256
    output_len: int = 128
    batch: int = 8
    n_problems: int = 200
    kv_cache_memory: int = 64 * 2**20  # the same budget for every method: a cheaper cache holds more


@dataclass
class Entry:
    method: str
    what: str
    latency_s: float  # batch 1: input_len prompt tokens in, output_len tokens out; median of TIMED_RUNS
    latency_range_s: tuple[float, float]  # the fastest and slowest run
    throughput_tok_s: float  # batch `batch`: tokens out per second; median of TIMED_RUNS
    throughput_range_tok_s: tuple[float, float]  # the slowest and fastest run
    peak_memory_bytes: int  # weights + cache + activations: the process's growth (CPU) or CUDA peak
    weights_bytes: int
    kv_cache_bytes_per_token: float
    accuracy: float | None  # exact match on the task family; None for other models
    mean_abs_logit_diff: float  # against the baseline (probes.py)
    greedy_agreement: float
    approximation: bool


@dataclass(frozen=True)
class MeasureSpec:
    method: str
    what: str
    model: str
    options: dict[str, Any]
    workload: Workload
    probes: str  # the baseline's probes file: written by the baseline, read by every other method
    baseline: bool = False
    approximation: bool = False

    @classmethod
    def from_json(cls, text: str) -> MeasureSpec:
        data = json.loads(text)
        return cls(**{**data, "workload": Workload(**data["workload"])})

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _timed_runs(fn: Any) -> list[float]:
    """Seconds of each of TIMED_RUNS calls of fn."""
    times = []
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure(spec: MeasureSpec) -> Entry:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        kernels.prepare_cpu_kernels()  # the kernels' library is the machine's, not the method's memory
    before = rss_bytes()
    w = spec.workload
    args = load_args(spec.model)
    task_family = is_task_family(spec.model)
    max_len = max(w.input_len + w.output_len, w.input_len + ANSWER_TOKENS) + 1
    if task_family:
        max_len = max(max_len, TASK_FAMILY_MAX_LEN)
    with LLM(spec.model, max_model_len=max_len, kv_cache_memory=w.kv_cache_memory, **spec.options) as llm:
        model, cache = llm.engine.model, llm.engine.cache
        weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
        cache_bytes = sum(t.nbytes for t in vars(cache).values() if isinstance(t, torch.Tensor))
        g = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(2, args.vocab_size, (w.input_len,), generator=g).tolist() for _ in range(w.batch)
        ]
        params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        latency = _timed_runs(lambda: llm.generate(prompts[0], params))
        rates = [w.batch * w.output_len / t for t in _timed_runs(lambda: llm.generate(prompts, params))]
        score = accuracy(ask(llm, [(p,) for p in held_out_sample(w.n_problems)])) if task_family else None
        probes_path = Path(spec.probes)
        if spec.baseline:
            baseline_probes(llm, probe_prompts(llm, args.vocab_size, w.input_len, task_family)).save(
                probes_path
            )
        agreement, logit_diff = compare(llm, Probes.load(probes_path))
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes() - before
    return Entry(
        method=spec.method,
        what=spec.what,
        latency_s=statistics.median(latency),
        latency_range_s=(min(latency), max(latency)),
        throughput_tok_s=statistics.median(rates),
        throughput_range_tok_s=(min(rates), max(rates)),
        peak_memory_bytes=peak,
        weights_bytes=weights,
        kv_cache_bytes_per_token=cache_bytes / (cache.num_blocks * cache.block_size),
        accuracy=score,
        mean_abs_logit_diff=logit_diff,
        greedy_agreement=agreement,
        approximation=spec.approximation,
    )


def main(argv: list[str]) -> int:
    entry = measure(MeasureSpec.from_json(argv[0]))
    print(ENTRY_PREFIX + json.dumps(asdict(entry)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
