"""Numbers given on the command line are checked by argparse as what they count (a count >= 1, a rate
> 0, a fraction, a sampling value as SamplingParams takes it), so a bad one is the usage line and exit 2
before anything loads; and no plain int or float option is left unchecked in any subcommand."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.launcher.cli import build_parser
from moelaunch.launcher.commands import sampling_value

BAD = [
    ["batch", "--model", "m", "--input", "i", "--output", "o", "--max-tokens", "0"],
    ["batch", "--model", "m", "--input", "i", "--output", "o", "--temperature", "nan"],
    ["batch", "--model", "m", "--input", "i", "--output", "o", "--top-p", "0"],
    ["batch", "--model", "m", "--input", "i", "--output", "o", "--seed", "1e23"],
    ["batch", "--model", "m", "--input", "i", "--output", "o", "--seed", "-1"],
    ["distill", "t", "o", "--layers", "2", "--experts", "4", "--lr", "-1"],
    ["distill", "t", "o", "--layers", "2", "--experts", "4", "--lr", "nan"],
    ["distill", "t", "o", "--experts", "4", "--layers", "0"],
    ["prune", "m", "o", "--sparsity", "1.5"],
    ["eval", "--n", "0"],
    ["convert", "quantize-int4", "s", "d", "--group-size", "0"],
    ["bench", "--range-ratio", "2"],
    ["bench", "--num-requests", "0"],
    ["bench", "serve", "--url", "u", "--request-rate", "nan"],
    ["report", "--batch", "0"],
    ["report", "--n-problems", "0"],
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a[:1] + a[-2:]) for a in BAD])
def test_a_bad_number_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser(argv[0]).parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-2]}" in err and "Traceback" not in err


def option_types() -> dict[str, object]:
    """Every option of every subcommand (nested ones too) with its argparse type."""
    found: dict[str, object] = {}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    walk(f"{name} {sub}".strip(), subparser)
            elif action.option_strings:
                found[f"{name} {action.option_strings[-1]}"] = action.type

    walk("", build_parser())
    return found


def test_no_subcommand_takes_an_unchecked_int_or_float():
    unchecked = sorted(name for name, kind in option_types().items() if kind in (int, float))
    assert unchecked == [], f"give these a checked type (commands/__init__.py): {unchecked}"


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "seed"]),
    st.one_of(st.text(max_size=12), st.integers().map(str), st.floats().map(str)),
)
def test_a_sampling_flag_takes_what_a_request_takes(field, text):
    try:
        value = sampling_value(field)(text)
    except argparse.ArgumentTypeError:
        return
    SamplingParams(**{field: value})  # whatever the flag took, a request takes too


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["engine.kv_cache_memory=1"], "engine.kv_cache_memory: given 1"),
        (["job.max_tokens=100000"], "job.max_tokens: given 100000"),
    ],
)
def test_engine_limits_a_deployment_cannot_run_are_refused_by_the_plan(capsys, overrides, says):
    """A cache that cannot hold one sequence (the plan used to say "fits"), and a job max_tokens no request
    could reach (it used to be clamped silently)."""
    from moelaunch.launcher.cli import main

    assert main(["plan", *[arg for o in overrides for arg in ("--set", o)]]) == 1
    assert says in capsys.readouterr().err
