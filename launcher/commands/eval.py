"""`launch eval --model DIR [--n 500]`: score a checkpoint of the task family on the held-out set.

Greedy answers through the engine (as `launch` and the API give them, with MTP speculative decoding when
the checkpoint has an MTP layer); reports accuracy per kind, expert load balance (max/mean tokens per
expert, per MoE layer) and MTP draft acceptance. The last line is `accuracy=<fraction> n=<count>`.
"""

from __future__ import annotations

import argparse

from moelaunch.launcher.api import LLM
from moelaunch.launcher.bundled.expert_load import ExpertLoad
from moelaunch.launcher.bundled.scoring import score_through_engine
from moelaunch.launcher.bundled.task_model import DEFAULT_CHECKPOINT
from moelaunch.launcher.bundled.tasks import HELD_OUT_SIZE, held_out_sample
from moelaunch.model.checkpoint import CheckpointReader
from moelaunch.model.config import load_args
from moelaunch.model.loading import has_mtp_weights


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help="exact-match accuracy of a task-family checkpoint on held-out problems"
    )
    p.add_argument(
        "--model", default=str(DEFAULT_CHECKPOINT), help="checkpoint directory (default: the shipped one)"
    )
    p.add_argument("--n", type=int, default=500, help=f"held-out problems to score (1..{HELD_OUT_SIZE})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    problems = held_out_sample(args.n)
    # MTP on when the checkpoint has the layer, to report its acceptance (greedy answers are the same).
    with_mtp = has_mtp_weights(load_args(args.model), CheckpointReader(args.model))
    with LLM(args.model, speculative="mtp" if with_mtp else None) as llm:
        # The main layers' gates and the MTP layer's, counted while the engine answers.
        with ExpertLoad(llm.engine.model) as load:
            score = score_through_engine(llm, problems)
        acceptance = llm.engine.stats.spec_acceptance
    for kind in score.total:
        print(f"{kind:8s} {score.right[kind]}/{score.total[kind]}")
    print("expert load, max/mean tokens per expert (1.00 is even):")
    for name, ratio in load.imbalance().items():
        print(f"  {name.removesuffix('.mlp.gate')}: {ratio:.2f}")
    if acceptance is None:
        print("MTP draft acceptance: n/a (no MTP weights in the checkpoint)")
    else:
        print(f"MTP draft acceptance: {acceptance:.4f} (speculative decoding through the engine)")
    print(f"accuracy={score.accuracy:.4f} n={len(problems)}")
    return 0
