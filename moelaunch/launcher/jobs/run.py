"""`launch CONFIG.yaml`: open the deployment's engine on its backend, then run the job's mode.

Backends give an LLM-shaped client (`.engine`, `.tokenizer`, `.spec`, `.shutdown()`); job modes
only use that, so a new backend or a new mode is one entry in a table.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from moelaunch.engine.build import EngineSpec
from moelaunch.engine.llm import LLM
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.launcher.deploy.config import DeployConfig
from moelaunch.launcher.deploy.plan import LaunchPlan, build_plan
from moelaunch.launcher.jobs.chat import chat_loop, lenient_stdin, terminal_lines
from moelaunch.launcher.jobs.output_lock import output_lock
from moelaunch.launcher.jobs.output_path import check_writable
from moelaunch.launcher.ray_llm import RayLLM
from moelaunch.model.weight_spec import WeightSpec
from moelaunch.parallel.mesh import MeshShape
from moelaunch.tasks.capabilities import capabilities_line
from moelaunch.text.files import check_readable, is_missing

DEMO_QUESTIONS = (
    "What is 123+456?",
    "Reverse DeepSeek",
    "Sort 9 3 77 1 50",
    "How many a in banana?",
    "What's 50-8",
)


def engine_spec(cfg: DeployConfig, plan: LaunchPlan) -> EngineSpec:
    """The engine the plan describes: its KV cache gets the plan's budget, as `launch plan` shows it."""
    model = Path(cfg.model)
    if not model.is_dir():
        raise cfg.error(
            "model", cfg.model, "a checkpoint directory to run (a config.json only serves `plan`)"
        )
    p = cfg.parallel
    per_layer = {str(i): [list(r) for r in pl.owners] for i, pl in plan.layer_placements.items()}
    weights = WeightSpec(str(model), cfg.dtype, cfg.quantization, p.expert_placement, per_layer or None)
    engine = cfg.engine.model_copy(update={"kv_cache_memory": plan.engine_kv_budget})
    return EngineSpec(weights, MeshShape(p.tp, p.dp, p.pp), engine, cfg.cluster.timeouts.collective_s)


def open_local(cfg: DeployConfig, spec: EngineSpec) -> LLM:
    return LLM.from_spec(spec, env=cfg.cluster.env)


BACKENDS: dict[str, Callable[[DeployConfig, EngineSpec], LLM | RayLLM]] = {"local": open_local, "ray": RayLLM}


def run_chat(client: LLM, cfg: DeployConfig) -> int:
    job = cfg.job

    def params(turn: int) -> SamplingParams:
        # Each turn draws from its own seed, the same on every run.
        return SamplingParams(**{**job.sampling(), "seed": (job.seed or 0) + turn})

    if (line := capabilities_line(cfg.model)) is not None:
        print(line)
    if sys.stdin.isatty():
        print("Chat (/clear resets the conversation, /exit quits).")
        idle_s = cfg.cluster.timeouts.collective_s / 3
        lines = terminal_lines(on_idle=client.engine.keepalive, idle_s=idle_s)
    else:
        # Piped turns, one per line; with nothing piped in, a short demo.
        lenient_stdin()
        piped = [line.rstrip("\n") for line in sys.stdin]
        # The demo asks its questions in one conversation, as a person would.
        lines = _echoed(piped or list(DEMO_QUESTIONS))
    chat_loop(client.engine, client.tokenizer, params, lines)
    return 0


def _echoed(lines: list[str]) -> Iterator[str]:
    """Show each piped turn as if typed at the prompt."""
    for line in lines:
        if line != "/clear":
            print(f">>> {line}", flush=True)
        yield line


def run_batch_job(client: LLM, cfg: DeployConfig) -> int:
    from moelaunch.launcher.jobs.batch import run_batch

    job = cfg.job
    defaults = job.sampling()
    # A line without a seed draws from the job's seed + a hash of its id (batch.default_seed).
    base_seed = defaults.pop("seed") or 0
    summary = run_batch(client, Path(job.input), Path(job.output), defaults, base_seed)
    print(summary.line(Path(job.output)))
    return summary.exit_code


def run_bench_job(client: LLM, cfg: DeployConfig) -> int:
    """Throughput and latency of the deployment as it runs (peers: `launch bench --compare`)."""
    from moelaunch.measure.bench.suite import BenchOptions, build_cases, run_ours_on
    from moelaunch.measure.bench.tables import OURS, results_table
    from moelaunch.measure.bench.workloads import warmup_case

    job = cfg.job
    model = client.spec.weights.model
    opts = BenchOptions(model=model, num_requests=job.num_requests, input_len=job.input_len,
                        output_len=job.output_len)  # fmt: skip
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    results = {OURS: run_ours_on(client, build_cases(opts, vocab), warmup_case(vocab))}
    print(results_table(results))
    print(json.dumps(results))
    if job.output:
        Path(job.output).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def run_serve_job(client: LLM, cfg: DeployConfig, sock: socket.socket | None = None) -> int:
    """sock: the listening socket run_deployment bound before the model loaded (bound here if None)."""
    from moelaunch.launcher.serve.listen import bind_server_socket
    from moelaunch.launcher.serve.run import run_serve

    with sock or bind_server_socket(cfg.server) as listening:
        return run_serve(client, cfg, listening)


MODES: dict[str, Callable[[LLM, DeployConfig], int]] = {
    "chat": run_chat,
    "batch": run_batch_job,
    "bench": run_bench_job,
    "serve": run_serve_job,
}


def check_job_files(cfg: DeployConfig) -> None:
    """The job's input and output, checked before the model loads."""
    job = cfg.job
    if job.mode == "batch":
        if is_missing(Path(job.input)):
            raise cfg.error("job.input", job.input, "an existing JSONL file of prompts")
        check_readable(Path(job.input), "job.input")
        check_writable(Path(job.output), "job.output")
    if job.mode == "bench" and job.output:
        check_writable(Path(job.output), "job.output")


def run_in_slurm_allocation(cfg: DeployConfig, overrides: list[str]) -> int:
    """`backend: slurm` inside an allocation: Ray over the allocation's nodes, then the job."""
    if "SLURM_JOB_ID" not in os.environ:
        raise cfg.error(
            "cluster.backend",
            "slurm",
            "inside a Slurm allocation only; submit with `launch slurm CONFIG.yaml`",
        )
    from moelaunch.launcher.deploy.slurm import run_in_allocation, sbatch_job

    return run_in_allocation(sbatch_job(cfg, Path(cfg.source), overrides))


def run_deployment(cfg: DeployConfig, overrides: list[str] | None = None) -> int:
    if cfg.cluster.backend == "slurm":
        return run_in_slurm_allocation(cfg, overrides or [])
    backend = BACKENDS.get(cfg.cluster.backend)
    if backend is None:
        raise cfg.error(
            "cluster.backend", cfg.cluster.backend, f"one of {', '.join(BACKENDS)} in this version"
        )
    mode = MODES.get(cfg.job.mode)
    if mode is None:
        raise cfg.error("job.mode", cfg.job.mode, f"one of {', '.join(MODES)} in this version")
    plan = build_plan(cfg)  # a layout that cannot work fails here, before any process starts
    if cfg.cluster.backend == "local" and plan.device == "cuda" and not torch.cuda.is_available():
        raise cfg.error(
            "cluster.device", "cuda", "cpu or auto: the local backend runs here, and here is no CUDA GPU"
        )
    if not plan.fits:
        raise ValueError(f"{plan.verdict()}; details: `launch plan {cfg.source}`")
    check_job_files(cfg)
    if cfg.job.mode == "chat" and plan.mesh.world == 1 and plan.device == "cpu":
        # A new user's first chat: the CPU kernels build in the background while it answers.
        os.environ.setdefault("MOELAUNCH_CPU_KERNELS", "background")
    with contextlib.ExitStack() as resources:
        if cfg.job.mode == "batch":  # one run per output file; a second fails here, before loading
            resources.enter_context(output_lock(Path(cfg.job.output)))
        if cfg.job.mode == "serve":
            from moelaunch.launcher.serve.listen import bind_server_socket

            cfg.server.api_key_in_effect()  # an empty MOELAUNCH_API_KEY fails here, not after the model loads
            # A port in use or a host this machine lacks too: the socket is bound before the model loads.
            mode = functools.partial(
                run_serve_job, sock=resources.enter_context(bind_server_socket(cfg.server))
            )
        client = backend(cfg, engine_spec(cfg, plan))
        graceful = False  # after Ctrl-C or a failure mid-step the ranks may be inside a collective
        try:
            code = mode(client, cfg)
            graceful = code == 0
            return code
        finally:
            client.shutdown(graceful)
