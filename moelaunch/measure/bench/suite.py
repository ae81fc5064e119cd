"""One benchmark run: the same cases through this engine and, with --compare, through the peers, one
system at a time in this process (vLLM in its own), then the results and ratios as one dict.

With `rounds` > 1 every system runs every case that many times and each metric is the median over
rounds. This engine and vLLM alternate round by round, so a slow spell on a shared machine hits both
rather than one; transformers (far behind, and in this process, whose peak RSS it would share) runs
its rounds after ours has been freed.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moelaunch.engine.llm import LLM
from moelaunch.engine.routed_load import TOTAL_ONLY_WINDOW
from moelaunch.measure.bench import hf_peer, ours
from moelaunch.measure.bench.metrics import CaseRun, summarize
from moelaunch.measure.bench.tables import OURS, Results, ratios
from moelaunch.measure.bench.vllm_peer import PeerFailed, run_vllm
from moelaunch.measure.bench.workloads import Case, latency_cases, throughput_case, warmup_case
from moelaunch.measure.machine import cpu_name, kernel_flags

CaseResults = dict[str, dict[str, Any]]  # case name -> metrics


@dataclass
class BenchOptions:
    model: str
    workload: str = "all"  # throughput | latency | all
    num_requests: int = 64
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.5
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    compare: bool = False
    vllm_venv: Path | None = None
    hf_batch_size: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int = 1 << 30
    seed: int = 0
    threads: int = max(1, (os.cpu_count() or 1) - 1)
    vllm_timeout_s: float = 1800.0
    rounds: int = 1
    dtype: str = "float32"  # every system's weights and activations (vLLM with the backend it needs)
    # This engine's projections and cache (the peers keep dtype's weights and cache).
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    compile: str = "auto"  # engine.compile for this engine
    expert_load: bool = False  # this engine records routed load: the result gets it, per MoE layer


def build_cases(opts: BenchOptions, vocab_size: int, seed: int | None = None) -> list[Case]:
    """The workload's cases, prompts drawn from `seed` (default opts.seed)."""
    seed = opts.seed if seed is None else seed
    cases = []
    if opts.workload in ("throughput", "all"):
        cases.append(
            throughput_case(
                opts.num_requests, opts.input_len, opts.output_len, opts.range_ratio, vocab_size, seed
            )
        )
    if opts.workload in ("latency", "all"):
        cases += latency_cases(list(opts.batch_sizes), opts.input_len, opts.output_len, vocab_size, seed)
    return cases


def vllm_attention_backend(dtype: str) -> str | None:
    """The MLA backend vLLM needs for `dtype` on the CPU (None: its own choice). On a CPU with AMX it
    picks AMX_MLA, which refuses fp32; its portable CPU_MLA runs fp32 everywhere."""
    return "CPU_MLA" if dtype == "float32" else None


def _log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def timed(system: str, cases: list[Case], run: Callable[[Case], CaseRun]) -> CaseResults:
    out = {}
    for case in cases:
        _log(f"{system} {case.name} ({len(case.requests)} requests)")
        out[case.name] = summarize(run(case), case.batch_size)
    return out


def run_suite(opts: BenchOptions) -> dict[str, Any]:
    config = json.loads((Path(opts.model) / "config.json").read_text())
    # Fresh prompts every round: a repeated prompt would be a prefix-cache hit in an engine that
    # stays up between rounds, and vLLM starts afresh each round.
    per_round = [build_cases(opts, config["vocab_size"], opts.seed + r) for r in range(opts.rounds)]
    warmup = warmup_case(config["vocab_size"])
    settings = {
        "max_model_len": max(c.max_len for c in [warmup, *(c for cs in per_round for c in cs)]),
        "max_num_batched_tokens": opts.max_num_batched_tokens,
        "max_num_seqs": max(256, *(len(c.requests) for c in per_round[0])),
        "kv_cache_memory": opts.kv_cache_memory,
    }
    ours = {
        "dtype": opts.dtype,
        "quantization": opts.quantization,
        "kv_cache_dtype": opts.kv_cache_dtype,
        "compile": opts.compile,
    }
    systems: dict[str, Any] = {OURS: ours}
    rounds: dict[str, list[CaseResults]] = {}
    threads_before = torch.get_num_threads()
    # Every system computes on the same number of threads (vLLM pins its own, see vllm_peer).
    torch.set_num_threads(opts.threads)
    try:
        _log(f"{OURS}: loading {opts.model}")
        recording = {"expert_load_window": TOTAL_ONLY_WINDOW} if opts.expert_load else {}
        with LLM(opts.model, **ours, **recording, **settings) as llm:
            for r, round_cases in enumerate(per_round):
                _log(f"round {r + 1} of {opts.rounds}")
                rounds.setdefault(OURS, []).append(run_ours_on(llm, round_cases, warmup))
                if opts.vllm_venv and "error" not in systems.get("vllm", {}):
                    systems["vllm"], vllm_results = _run_vllm(opts, round_cases, warmup, settings)
                    if vllm_results:
                        rounds.setdefault("vllm", []).append(vllm_results)
            if opts.expert_load:
                load = llm.engine.read_expert_load()
                counts = {str(layer): c.tolist() for layer, c in load.by_layer(load.total).items()}
                systems[OURS] = {**ours, "expert_load": {"tokens": load.tokens(load.total), "counts": counts}}
        gc.collect()  # our model and cache go before transformers loads
        if opts.compare:
            systems["transformers"], rounds["transformers"] = _run_transformers(opts, per_round, warmup)
    finally:
        torch.set_num_threads(threads_before)
    results: Results = {name: median_over_rounds(runs) for name, runs in rounds.items()}
    return {
        "model": str(opts.model),
        "machine": {
            "cpu": cpu_name(),
            "flags": kernel_flags(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "settings": {**settings, **{k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()}},
        "systems": systems,
        "results": results,
        "ratios": ratios(results),
        **({"rounds": rounds} if opts.rounds > 1 else {}),
    }


def median_over_rounds(runs: list[CaseResults]) -> CaseResults:
    """Each case's metrics as the median over rounds (a metric that is None in any round stays None)."""
    out: CaseResults = {}
    for case in runs[0]:
        out[case] = {}
        for metric in runs[0][case]:
            values = [run[case][metric] for run in runs]
            out[case][metric] = None if None in values else round(statistics.median(values), 3)
    return out


def run_ours_on(llm: LLM, cases: list[Case], warmup: Case) -> CaseResults:
    """The cases on an already running engine client (any backend), after an untimed warmup."""
    ours.run_case(llm, warmup)
    return timed(OURS, cases, lambda c: ours.run_case(llm, c))


def _run_transformers(
    opts: BenchOptions, per_round: list[list[Case]], warmup: Case
) -> tuple[dict[str, Any], list[CaseResults]]:
    import transformers

    _log("transformers: loading")
    model = hf_peer.load_hf_model(opts.model, getattr(torch, opts.dtype))
    hf_peer.run_case(model, warmup, opts.hf_batch_size)
    results = [
        timed("transformers", cases, lambda c: hf_peer.run_case(model, c, opts.hf_batch_size))
        for cases in per_round
    ]
    return {"version": transformers.__version__, "dtype": opts.dtype}, results


def _run_vllm(
    opts: BenchOptions, cases: list[Case], warmup: Case, settings: dict[str, Any]
) -> tuple[dict[str, Any], CaseResults | None]:
    backend = vllm_attention_backend(opts.dtype)
    _log(f"vllm: in {opts.vllm_venv} (a subprocess), {opts.dtype}, MLA backend {backend or 'its own'}")
    peer_settings = {**settings, "dtype": opts.dtype, "attention_backend": backend}
    try:
        version, runs = run_vllm(
            opts.vllm_venv, opts.model, [warmup, *cases], peer_settings, opts.threads, opts.vllm_timeout_s
        )
    except PeerFailed as e:
        _log(f"vllm: skipped: {e}")
        return {"error": str(e)}, None
    return {"version": version, "dtype": opts.dtype, "attention_backend": backend or "default"}, {
        c.name: summarize(runs[c.name], c.batch_size) for c in cases
    }
