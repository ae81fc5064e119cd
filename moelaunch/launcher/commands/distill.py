"""`launch distill TEACHER OUT --layers L --experts E [--features] [--steps N] [--prompts FILE] [--resume]`:
train a smaller student on the teacher's outputs and write it as a checkpoint (launcher/compress)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from moelaunch.launcher.commands import count, positive_number, sampling_value
from moelaunch.tools.distill import DEFAULT_TRAIN, DistillConfig, distill


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill", help="distill a checkpoint into one with fewer layers and experts")
    p.add_argument("teacher", help="teacher Hugging Face checkpoint directory")
    p.add_argument("out", help="student directory (new or empty; with --resume, the run's own)")
    p.add_argument(
        "--layers", type=count, required=True, help="student decoder layers (evenly spaced teacher layers)"
    )
    p.add_argument("--experts", type=count, required=True, help="student routed experts per MoE layer")
    p.add_argument("--features", action="store_true", help="also match the teacher's hidden states (MSE)")
    p.add_argument("--steps", type=count, default=DEFAULT_TRAIN.steps)
    p.add_argument("--batch", type=count, default=DEFAULT_TRAIN.batch, help="sequences per step")
    p.add_argument("--lr", type=positive_number, default=DEFAULT_TRAIN.lr)
    p.add_argument(
        "--temperature",
        type=positive_number,
        default=DistillConfig.temperature,
        help="softening of both distributions",
    )
    p.add_argument("--seed", type=sampling_value("seed"), default=DEFAULT_TRAIN.seed)
    p.add_argument(
        "--prompts",
        type=Path,
        help="training text: one prompt a line, or JSON lines {prompt} / {messages} "
        "(default: problems of the bundled task family, scored on their answers)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the state saved in OUT")
    p.add_argument("--n-group", type=count, help="a new n_group for the student's router")
    p.add_argument("--topk-group", type=count, help="a new topk_group for the student's router")
    # One thread by default: results depend on the thread count (a resumed run must match).
    p.add_argument("--threads", type=count, default=1, help="torch CPU threads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    cfg = DistillConfig(
        teacher=Path(args.teacher),
        out=Path(args.out),
        layers=args.layers,
        experts=args.experts,
        features=args.features,
        prompts=args.prompts,
        resume=args.resume,
        temperature=args.temperature,
        n_group=args.n_group,
        topk_group=args.topk_group,
        train=replace(DEFAULT_TRAIN, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed),
    )
    try:
        distill(cfg)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"interrupted: the state of every {cfg.train.save_every}th step is in {cfg.out}; "
            "continue with the same command and --resume"
        ) from None
    print(f"wrote {cfg.out}")
    return 0
