"""Train and write the shipped small model.

`python -m moelaunch.training.small_model --out checkpoints/small`
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moelaunch.training.small_model.train import TrainConfig, train


def main(argv: list[str] | None = None) -> int:
    defaults = TrainConfig(out=Path("checkpoints/small"))
    p = argparse.ArgumentParser(prog="python -m moelaunch.training.small_model", description=__doc__)
    p.add_argument("--out", type=Path, default=defaults.out, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch", type=int, default=defaults.batch, help="rows of packed conversations per step")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument(
        "--routing-steps",
        type=int,
        default=defaults.routing_steps,
        help="steps of balancing the routing bias on an even mix of kinds after training",
    )
    p.add_argument("--tiny", action="store_true", help="a toy-sized model, for a smoke run")
    # Results depend on the thread count, so it is fixed: the shipped checkpoint's recipe uses two, which
    # nearly halves a step's time against one.
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (fixed for reproducibility)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    train(
        TrainConfig(
            out=a.out,
            steps=a.steps,
            batch=a.batch,
            lr=a.lr,
            seed=a.seed,
            tiny=a.tiny,
            routing_steps=a.routing_steps,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
