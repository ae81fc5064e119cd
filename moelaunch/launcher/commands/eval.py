"""`launch eval --model DIR [--n 1000] [--multi-turn | --english]`: score a checkpoint of the bundled task
family.

The held-out problems go through the engine, the path of `launch` and the API (greedy, MTP speculative
decoding when the checkpoint has an MTP layer), all in one batch per turn. Reports exact match per skill,
per form and per turn position (`--multi-turn`: conversations of 2-6 turns, each turn asked after the
model's own earlier replies; `--english`: reversing and counting real English words, which training
never draws on purpose), expert load balance (max/mean tokens per expert, per MoE layer, over every
token the engine ran, as the engine records it; `--expert-load-out FILE` writes those counts in the
expert-load format `launch plan --expert-load` reads) and MTP draft acceptance. Arithmetic and counting
are answered after a think section of worked steps; the report says how many of those steps were
right. The last line is `accuracy=<fraction> n=<answers>`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from moelaunch.launcher.commands import count
from moelaunch.launcher.jobs.output_path import check_writable
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT, Answer, accuracy, ask, open_engine, tally
from moelaunch.model.expert_load_file import write_expert_load
from moelaunch.tasks.problem_sets import (
    HELD_OUT_SIZE,
    conversations_sample,
    english_problems,
    held_out_sample,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="exact-match accuracy of a task-family checkpoint on held-out problems, through the engine",
    )
    p.add_argument(
        "--model", default=str(DEFAULT_CHECKPOINT), help="checkpoint directory (default: the shipped one)"
    )
    p.add_argument(
        "--n", type=count, default=HELD_OUT_SIZE, help=f"held-out questions to score (1..{HELD_OUT_SIZE})"
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--multi-turn", action="store_true", help="score conversations of 2-6 turns (about --n turns in all)"
    )
    which.add_argument(
        "--english",
        action="store_true",
        help=f"score reversing and counting English words ({len(english_problems())} problems, at most --n)",
    )
    p.add_argument(
        "--expert-load-out",
        type=Path,
        metavar="FILE",
        help="write the tokens routed to each expert per MoE layer (JSON, moelaunch-expert-load/1)",
    )
    p.set_defaults(func=run)


def _print_table(title: str, rows: dict[str, tuple[int, int]]) -> None:
    print(f"{title}:")
    for name, (right, total) in rows.items():
        print(f"  {name:12s} {right:4d}/{total:<4d} {right / total:.3f}")


def print_accuracy(answers: list[Answer], multi_turn: bool) -> None:
    _print_table("per skill", tally(answers, lambda a: a.problem.kind))
    _print_table("per form", tally(answers, lambda a: a.problem.form))
    if multi_turn:
        _print_table("per turn", tally(sorted(answers, key=lambda a: a.turn), lambda a: a.turn))
        later = [a for a in answers if a.turn > 1]
        print(f"turns 2-6: {accuracy(later):.4f} ({sum(a.correct for a in later)}/{len(later)})")
    _print_reasoning(answers)


def _print_reasoning(answers: list[Answer]) -> None:
    """Where the errors of skills answered after worked steps come from: the steps or the last read."""
    worked = [a for a in answers if a.problem.reasoning]
    if not worked:
        return
    steps_right = [a for a in worked if a.reasoning == a.problem.reasoning]
    misread = sum(not a.correct for a in steps_right)
    print(
        f"think sections: {len(steps_right)}/{len(worked)} with the right steps; "
        f"{misread} of those answered wrong"
    )


def run(args: argparse.Namespace) -> int:
    if args.expert_load_out:
        check_writable(args.expert_load_out, "--expert-load-out")
    if args.multi_turn:
        conversations = conversations_sample(args.n)
    else:
        conversations = [
            (p,) for p in (english_problems()[: args.n] if args.english else held_out_sample(args.n))
        ]
    llm = open_engine(args.model, record_load=True)
    start = time.time()
    try:
        answers = ask(llm, conversations)
        load = llm.engine.read_expert_load()
    finally:
        llm.shutdown()
    print_accuracy(answers, args.multi_turn)
    print("expert load, max/mean tokens per expert (1.00 is even):")
    n_layers = llm.engine.model.args.num_hidden_layers
    for layer, ratio in load.expert_imbalance(load.total).items():
        print(f"  layer {layer}{' (MTP)' if layer >= n_layers else ''}: {ratio:.2f}")
    if args.expert_load_out:
        write_expert_load(args.expert_load_out, load.tokens(load.total), load.by_layer(load.total))
        print(f"expert load of {load.tokens(load.total)} tokens written to {args.expert_load_out}")
    acceptance = llm.engine.stats.spec_acceptance
    print(
        "MTP draft acceptance: "
        + ("n/a (no MTP weights in the checkpoint)" if acceptance is None else f"{acceptance:.4f}")
    )
    print(f"{len(answers)} answers in {time.time() - start:.0f}s")
    print(f"accuracy={accuracy(answers):.4f} n={len(answers)}")
    return 0
