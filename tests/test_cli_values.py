"""Numbers given on the command line are checked by argparse as what they count (a count >= 1, a rate
> 0, a fraction, a sampling value as SamplingParams takes it), so a bad one is the usage line and exit 2
before anything loads."""

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
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a[:1] + a[-2:]) for a in BAD])
def test_a_bad_number_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser(argv[0]).parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-2]}" in err and "Traceback" not in err


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
