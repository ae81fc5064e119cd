"""`launch demo` (and `launch` with no arguments): the bundled small model answers a few questions,
or chats when stdin is a terminal."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .task_model import DEFAULT_CHECKPOINT, run_demo


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="talk to the bundled small DeepSeek-V3-architecture model")
    p.add_argument("--model", default=str(DEFAULT_CHECKPOINT), help="checkpoint directory")
    p.add_argument("--chat", action="store_true", help="interactive chat even when stdin is not a terminal")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not (Path(args.model) / "config.json").exists():
        raise FileNotFoundError(
            f"no checkpoint at {args.model}: pass --model DIR, or train the bundled one with "
            "`python -m launcher.train_small --out checkpoints/small`"
        )
    if args.chat or sys.stdin.isatty():
        from .generate import main as generate_main

        print("Chat with the bundled model (/clear resets, /exit quits). Try: What is 12+34?")
        return generate_main(["--ckpt-path", args.model, "--interactive", "--temperature", "0"])
    run_demo(args.model)
    return 0
