"""`launch report [--model DIR] [--methods ...] [--device cpu|cuda] [--out DIR]`: the baseline and each
optimization method measured in one run (speed, memory, quality), as a table, report.json, report.md and
report.png. Each method runs in a process of its own; derived checkpoints are written under OUT."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from moelaunch.launcher.commands import count
from moelaunch.launcher.jobs.output_path import check_writable
from moelaunch.measure.machine import machine_line
from moelaunch.measure.report.measure import ENTRY_PREFIX, Entry, MeasureSpec, Workload
from moelaunch.measure.report.methods import DISTILLED, METHODS, Method
from moelaunch.measure.report.render import chart, markdown, text_table, write_json
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT
from moelaunch.model.checkpoint import CheckpointReader, check_writable_dir
from moelaunch.model.config import load_args
from moelaunch.model.loading import has_mtp_weights
from moelaunch.tasks.capabilities import is_task_family
from moelaunch.tasks.problem_sets import HELD_OUT_SIZE

METHOD_TIMEOUT_S = 1800.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="measure every optimization method's speed, memory and quality")
    p.add_argument("--model", default=str(DEFAULT_CHECKPOINT), help="checkpoint (default: the bundled one)")
    p.add_argument(
        "--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS), help="default: all"
    )
    p.add_argument("--student", type=Path, help="a distilled checkpoint (`launch distill`) to report too")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when there is a GPU")
    p.add_argument("--out", type=Path, default=Path("report"), help="output directory (default: %(default)s)")
    p.add_argument("--input-len", type=count, default=256)
    p.add_argument("--output-len", type=count, default=128)
    p.add_argument("--batch", type=count, default=8, help="batch size of the throughput run")
    p.add_argument("--n-problems", type=count, default=200, help="task-family problems scored for accuracy")
    p.add_argument(
        "--kv-cache-memory", type=count, default=Workload.kv_cache_memory, help="bytes, every method"
    )
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> Workload:
    """Everything that can be wrong with the arguments, before any method runs."""
    vocab = load_args(args.model).vocab_size  # a missing or broken checkpoint fails here
    if args.student is not None:
        load_args(args.student)
    if not 1 <= args.n_problems <= HELD_OUT_SIZE:
        raise ValueError(f"--n-problems {args.n_problems}: must be in 1..{HELD_OUT_SIZE}")
    if vocab < 3:
        raise ValueError(f"{args.model}: a vocabulary of {vocab} leaves no tokens for the probe prompts")
    if args.device == "cuda" and not _has_cuda():
        raise ValueError("--device cuda: no CUDA GPU is visible here; leave --device out or use --device cpu")
    check_writable_dir(args.out, "--out")
    args.out.mkdir(parents=True, exist_ok=True)
    check_writable(args.out / "report.json", "--out")
    return Workload(args.input_len, args.output_len, args.batch, args.n_problems, args.kv_cache_memory)


def _derive(method: Method, model: str, out: Path) -> str:
    """The method's checkpoint, written afresh by its `launch` tool under OUT (one left by an earlier run
    may come from another model)."""
    dst = out / "checkpoints" / method.name
    shutil.rmtree(dst, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "moelaunch.launcher.cli",
        *method.derive(load_args(model)),
        model,
        str(dst),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=METHOD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"`{shlex.join(command[3:])}` failed: {done.stderr.strip().splitlines()[-1:]}")
    return str(dst)


def _measure(spec: MeasureSpec, env: dict[str, str]) -> Entry:
    command = [sys.executable, "-m", "moelaunch.measure.report.measure", spec.to_json()]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=METHOD_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith(ENTRY_PREFIX)]
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"exit code {done.returncode}: {tail[0]}")
    return Entry(**json.loads(lines[-1].removeprefix(ENTRY_PREFIX)))


def run(args: argparse.Namespace) -> int:
    workload = _check(args)
    device = args.device or ("cuda" if _has_cuda() else "cpu")
    machine = machine_line(device)
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    methods = [METHODS["baseline"], *(METHODS[m] for m in args.methods if m != "baseline")]
    if args.student is not None:
        methods.append(DISTILLED)
    probes = args.out / "baseline_probes.json"
    entries: list[Entry] = []
    failures: dict[str, str] = {}
    has_mtp = has_mtp_weights(load_args(args.model), CheckpointReader(args.model))
    for method in methods:
        if method.options.get("speculative") == "mtp" and not has_mtp:
            print(f"report: {method.name} skipped: {args.model} has no MTP layer", file=sys.stderr)
            continue
        started = time.monotonic()
        try:
            model = str(args.student) if method is DISTILLED else args.model
            if method.derive is not None:
                model = _derive(method, args.model, args.out)
            spec = MeasureSpec(
                method.name, method.what, model, method.options, workload, str(probes),
                baseline=method.name == "baseline", approximation=method.approximation,
            )  # fmt: skip
            entries.append(_measure(spec, env))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            if method.name == "baseline":
                raise RuntimeError(
                    f"the baseline could not be measured ({e}); no method can be compared"
                ) from e
            failures[method.name] = str(e)
        print(
            f"report: {method.name} measured in {time.monotonic() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    command = shlex.join(["launch", *sys.argv[1:]]) if sys.argv[1:2] == ["report"] else "launch report"
    scored = (
        f"{workload.n_problems} held-out problems"
        if is_task_family(args.model)
        else "n/a (not the bundled task family: quality is the drift from the baseline)"
    )
    setup = (
        f"Model {args.model} on {device} ({machine}); latency: batch 1, {workload.input_len} tokens in, "
        f"{workload.output_len} out; throughput: batch {workload.batch}; accuracy: {scored}; KV cache "
        f"budget {workload.kv_cache_memory / 2**20:.0f} MiB for every method."
    )
    print(setup)
    print(text_table(entries))
    for name, why in failures.items():
        print(f"report: {name} failed: {why}", file=sys.stderr)
    write_json(entries, args.out / "report.json")
    (args.out / "report.md").write_text(markdown(entries, failures, command, setup))
    chart(entries, args.out / "report.png", f"launch report: {Path(args.model).name} on {device}")
    print(f"wrote {args.out / 'report.json'}, report.md and report.png")
    return 1 if failures else 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
