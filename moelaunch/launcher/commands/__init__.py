"""The `launch` subcommands, one module each: batch, bench, convert, distill, eval, k8s, plan, prune,
serve, slurm."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, get_args

from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.launcher.deploy.config import DEFAULT_CONFIG


def count(text: str) -> int:
    """argparse type for a flag that counts something (ranks, tokens, requests): an integer >= 1, refused
    with the usage line before anything loads (0 or -1 would otherwise load the model, then hang or skip
    every line)."""
    return _integer(text, least=1)


def count_or_zero(text: str) -> int:
    """argparse type for a count that may be 0 (extra copies, say): an integer >= 0."""
    return _integer(text, least=0)


def _integer(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value}: give {least} or more")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive_number(text: str) -> float:
    """argparse type for a rate or a temperature: a finite number > 0 (nan, inf, 0 and -1 refused)."""
    value = _number(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{value}: give a finite number > 0")
    return value


def rate(text: str) -> float:
    """argparse type for a rate that may be unbounded: a number > 0, inf allowed (nan refused)."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value}: give a number > 0 (inf: all at once)")
    return value


def fraction(text: str) -> float:
    """argparse type for a share of something: a number in [0, 1)."""
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give a number in [0, 1)")
    return value


def sampling_value(field: str) -> Callable[[str], Any]:
    """argparse type for a flag that sets SamplingParams.<field>: parsed as the field's number type and
    checked by SamplingParams itself, so the flag takes exactly what a request takes, and a bad value
    (0 tokens, a nan temperature, a seed past 2^63) is refused with the usage line before anything loads."""
    annotation = SamplingParams.model_fields[field].annotation
    kind = int if annotation is int or int in get_args(annotation) else float

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        try:
            SamplingParams(**{field: value})
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("SamplingParams.")) from None
        return value

    parse.__name__ = field  # argparse names the type in its messages
    return parse


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
