"""`launch batch --model DIR --input prompts.jsonl --output results.jsonl [--tp --dp --pp ...]`.

Runs every input line through the engine and appends one result line per request as it finishes;
rerunning the same command resumes (ids already in the output are skipped); a second run on an output
that a run is writing fails at once (the output's lock, OUTPUT.lock). Bad input lines are
reported on stderr with their line numbers and skipped. The last stdout line is a summary; the exit
code is 0 once every runnable line is in the output, even when some lines were skipped (the summary
lists them), so a rerun after fixing those lines runs only them; it is 1 when a line failed as it ran
(non-finite logits from broken weights), which is reported on stderr and not written, and when every
line was skipped (nothing could run: the wrong file, or one mistake on every line).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moelaunch.engine.llm import LLM
from moelaunch.launcher.commands import count, sampling_value
from moelaunch.launcher.jobs.batch import run_batch
from moelaunch.launcher.jobs.output_lock import output_lock
from moelaunch.launcher.jobs.output_path import check_writable
from moelaunch.text.files import check_readable


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "batch", help="run a JSONL file of prompts through the engine (resumable)", description=__doc__
    )
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--input", required=True, type=Path, help='JSONL: {"id", "prompt" | "messages", ...}')
    p.add_argument("--output", required=True, type=Path, help="JSONL results, appended (resumes)")
    p.add_argument("--tp", type=count, default=1, help="tensor parallel size")
    p.add_argument("--dp", type=count, default=1, help="data parallel attention replicas")
    p.add_argument("--pp", type=count, default=1, help="pipeline stages")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--max-model-len", type=count, help="longest prompt + output (default: the model's, <= 8192)"
    )
    p.add_argument("--kv-cache-memory", type=count, help="bytes per rank for the KV cache")
    p.add_argument("--max-num-seqs", type=count, default=256, help="sequences per step and replica")
    sampling = p.add_argument_group("sampling defaults (a line's own fields override them)")
    sampling.add_argument("--max-tokens", type=sampling_value("max_tokens"), default=256)
    sampling.add_argument(
        "--temperature", type=sampling_value("temperature"), help="default 1.0; 0 is greedy"
    )
    sampling.add_argument("--top-p", type=sampling_value("top_p"), help="default 1.0")
    sampling.add_argument("--top-k", type=sampling_value("top_k"), help="default -1 (no limit)")
    sampling.add_argument(
        "--seed",
        type=sampling_value("seed"),
        default=0,
        help="a line without a seed uses SEED + crc32(id): resumable sampling",
    )
    p.add_argument("--max-in-flight", type=count, help="requests held by the engine at once")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
    }
    return {k: v for k, v in given.items() if v is not None}


def run(args: argparse.Namespace) -> int:
    check_readable(args.input, "--input")  # before loading the model, which can take minutes
    check_writable(args.output, "--output")
    options: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    if args.kv_cache_memory:
        options["kv_cache_memory"] = args.kv_cache_memory
    with (
        output_lock(args.output),  # a second run on this output fails here, before its model loads
        LLM(args.model, tp=args.tp, dp=args.dp, pp=args.pp, dtype=args.dtype, **options) as llm,
    ):
        summary = run_batch(
            llm,
            args.input,
            args.output,
            sampling_defaults(args),
            args.seed,
            args.max_in_flight,
            progress=not args.no_progress,
        )
    print(summary.line(args.output), flush=True)
    return summary.exit_code
