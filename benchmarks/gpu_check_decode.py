"""benchmarks/gpu_check.py, parts 2 and 3: the random DeepSeek-V3-shaped model (bf16, and its block-FP8
twin made by `launch convert quantize-fp8`'s code), decode tok/s through this engine (CUDA graphs on and
off) and transformers' generate, and one batch-1 decode step under torch.profiler."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check_roofline import weight_bytes
from moelaunch.engine.llm import LLM
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.engine.static_decode import static_decode_supported
from moelaunch.engine.step_ops import StepOps
from moelaunch.measure.bench import hf_peer, ours
from moelaunch.measure.bench.metrics import summarize
from moelaunch.measure.bench.workloads import latency_cases, warmup_case
from moelaunch.measure.random_checkpoint import write_random_checkpoint
from moelaunch.tools.convert import quantize_fp8

# Engine settings per mode: "graphs" replays each measured batch's step as a CUDA graph; compile stays
# off in both, so the pair isolates the graphs (compiling three buckets would not fit the time box).
MODES = {"eager": {"cuda_graphs": False, "compile": "off"}, "graphs": {"cuda_graphs": True, "compile": "off"}}


def make_models(workdir: Path, quick: bool, device: torch.device, fp8: bool) -> dict[str, Any]:
    """The bf16 checkpoint (drawn on `device`) and, with `fp8`, its FP8 twin; each one's weight bytes."""
    out: dict[str, Any] = {}
    bf16 = workdir / "bf16"
    if not (bf16 / "config.json").exists():
        shape = "tiny" if quick else "gpu-check"
        write_random_checkpoint(bf16, shape, dtype=torch.bfloat16, device=device.type)
    out["bf16"] = weight_bytes(bf16)
    if fp8:
        twin = workdir / "fp8"
        if not (twin / "config.json").exists():
            quantize_fp8(bf16, twin)
        out["fp8"] = weight_bytes(twin)
    return out


def _engine(path: Path, dtype: str, mode: str, batches: list[int], max_len: int) -> LLM:
    return LLM(
        str(path),
        dtype=dtype,
        skip_tokenizer_init=True,
        max_model_len=max_len,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, max_len),
        kv_cache_memory=1 << 30,  # explicit: the default takes 0.9 of the GPU's free memory
        cuda_graph_sizes=batches,
        **MODES[mode],
    )


class Rounds:
    """Timed runs into figures[name]: each run once as soon as its engine is ready, then again up to
    `rounds` times while its last duration still fits before the deadline (a time.time() the parent
    set). Saved after every run, so a timeout keeps what was measured."""

    def __init__(self, deadline: float, save: Callable[[], None]) -> None:
        self.deadline, self.save = deadline, save
        self.figures: dict[str, list[float]] = {}
        self.runs: list[tuple[str, Callable[[], float]]] = []
        self.took: dict[str, float] = {}

    def first(self, runs: list[tuple[str, Callable[[], float]]]) -> None:
        for name, run in runs:
            self._measure(name, run)
        self.runs += runs

    def more(self, rounds: int) -> None:
        for _ in range(rounds - 1):
            for name, run in self.runs:
                # With room to spare: a run may take longer than the last, and the engines shut down after.
                if time.time() + 1.5 * self.took[name] + 5 <= self.deadline:
                    self._measure(name, run)

    def _measure(self, name: str, run: Callable[[], float]) -> None:
        start = time.time()
        self.figures.setdefault(name, []).append(run())
        self.took[name] = time.time() - start
        self.save()


def decode(
    workdir: Path,
    dtype: str,
    device: torch.device,
    batches: list[int],
    lens: tuple[int, int],
    rounds: int,
    deadline: float,
    save: Callable[[dict[str, Any]], None],
) -> None:
    """This engine's decode tok/s per mode and batch (B / mean time per output token, as `launch bench`
    computes it), `rounds` times each where time allows."""
    path = workdir / ("fp8" if dtype == "fp8" else "bf16")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    result: dict[str, Any] = {"notes": {}}
    timed = Rounds(deadline, lambda: save(result))
    result["figures"] = timed.figures
    modes = list(MODES) if device.type == "cuda" else ["eager"]
    if device.type != "cuda":
        result["notes"]["graphs"] = "skipped: CUDA graphs need CUDA"
    engines: list[LLM] = []
    warmup = warmup_case(vocab)
    max_len = max(sum(lens), warmup.max_len)
    for mode in modes:
        llm = _engine(path, "bfloat16" if dtype == "bf16" else dtype, mode, batches, max_len)
        if mode == "graphs" and llm.engine.runner.static is None:
            # Its figures would be the eager ones again: say why, and spend the time elsewhere.
            engine = llm.engine
            why = static_decode_supported(engine.model, engine.cache, True) or "the static step is off"
            result["notes"][mode] = f"not measured: no graphs, every decode step stays eager ({why})"
            save(result)
            llm.shutdown()
            continue
        engines.append(llm)
        ours.run_case(llm, warmup)
        timed.first(
            [
                (f"{mode} b{c.batch_size}", _decode_tok_s(llm, c))
                for c in latency_cases(batches, *lens, vocab, 1)
            ]
        )
    timed.more(rounds)
    for llm in engines:
        llm.shutdown()


def _decode_tok_s(llm: LLM, case: Any) -> Callable[[], float]:
    return lambda: summarize(ours.run_case(llm, case), case.batch_size)["decode_tok_s"]


def hf_decode(
    workdir: Path,
    device: torch.device,
    batches: list[int],
    lens: tuple[int, int],
    rounds: int,
    deadline: float,
    save: Callable[[dict[str, Any]], None],
) -> None:
    """transformers' generate in bf16 on the same checkpoint and prompts (hf_peer: static batches)."""
    path = workdir / "bf16"
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    model = hf_peer.load_hf_model(str(path), torch.bfloat16, device.type)
    hf_peer.run_case(model, warmup_case(vocab), 2)
    result: dict[str, Any] = {}
    timed = Rounds(deadline, lambda: save(result))
    result["figures"] = timed.figures

    def run(case: Any) -> Callable[[], float]:
        return lambda: summarize(hf_peer.run_case(model, case, case.batch_size), case.batch_size)[
            "decode_tok_s"
        ]

    timed.first([(f"b{c.batch_size}", run(c)) for c in latency_cases(batches, *lens, vocab, seed=1)])
    timed.more(rounds)


def profile_step(workdir: Path, device: torch.device, lens: tuple[int, int], steps: int) -> dict[str, Any]:
    """One batch-1 decode step per mode, as the mean of `steps` steps: wall time (unprofiled), then under
    torch.profiler the GPU-busy share (the union of kernel intervals over that wall time), kernels run
    and kernel launch calls; device ops and syncs of one step under StepOps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for mode in MODES if device.type == "cuda" else ["eager"]:
        llm = _engine(workdir / "bf16", "bfloat16", mode, [1], lens[0] + 2 * steps + 16)
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
        engine.add_request("profile", list(range(2, 2 + lens[0])), params)
        for _ in range(4):
            engine.step()  # prefill, then decode steps: lazy set-up and first replays off the profile
        with StepOps() as ops:
            engine.step()
        sync()
        start = time.perf_counter()  # wall time unprofiled: the profiler slows the host down
        for _ in range(steps):
            engine.step()
        sync()
        wall = (time.perf_counter() - start) / steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            sync()
        events = prof.events()
        row: dict[str, Any] = {"wall_ms": 1e3 * wall, "ops": ops.total, "syncs": len(ops.syncs)}
        if device.type == "cuda":
            kernels = [
                e
                for e in events
                if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
            ]
            busy = _union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / steps
            row |= {
                "gpu_busy_ms": busy / 1e3,
                "gpu_busy_share": busy / 1e6 / wall,
                "kernels": len(kernels) / steps,
                "launch_calls": sum("LaunchKernel" in e.name for e in events) / steps,
                "graph_launches": sum("GraphLaunch" in e.name for e in events) / steps,
            }
        out[mode] = row
        while engine.has_unfinished():
            engine.step()
        llm.shutdown()
    if device.type != "cuda":
        out["note"] = "GPU busy share, kernels and launches skipped: the profiler's CUDA times need CUDA"
    return out


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams may overlap)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
