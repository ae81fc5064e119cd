"""The `launch` subcommands, one module each: batch, bench, convert, distill, eval, k8s, plan, prune,
serve, slurm."""

from __future__ import annotations

import argparse

from moelaunch.launcher.deploy.config import DEFAULT_CONFIG


def count(text: str) -> int:
    """argparse type for a flag that counts something (ranks, tokens, requests): an integer >= 1, refused
    with the usage line before anything loads (0 or -1 would otherwise load the model, then hang or skip
    every line)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more")
    return value


def add_deployment_arguments(p: argparse.ArgumentParser, config_required: bool = False) -> None:
    """CONFIG.yaml and `--set KEY.PATH=VALUE` overrides (args.config, args.overrides), as every command
    that reads a deployment file takes them."""
    if config_required:
        p.add_argument("config", help="cluster YAML")
    else:
        p.add_argument(
            "config", nargs="?", default=str(DEFAULT_CONFIG), help="cluster YAML (default: %(default)s)"
        )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a key, e.g. --set parallel.tp=8",
    )
