"""Fuzzed user input: deployment files, sampling parameters, batch lines and server request bodies.

Whatever comes in, the answer is a value or the one error type that names the cause (a ValueError, a
DeployConfigError, a LineError, a 400), never a TypeError, KeyError or another traceback from inside.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.launcher.deploy.config import DeployConfigError, load_deploy_config
from moelaunch.launcher.deploy.plan import build_plan
from moelaunch.launcher.jobs.batch import LineError, parse_line
from moelaunch.launcher.serve.handlers import APIError, parse_body
from moelaunch.launcher.serve.protocol import ChatCompletionRequest, CompletionRequest
from moelaunch.parallel.mesh import LayoutError

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop", "stop_token_ids",
                   "seed", "ignore_eos", "logprobs", "n"]  # fmt: skip
LINE_KEYS = ["id", "prompt", "messages", *SAMPLING_FIELDS]


@FUZZ
@given(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), VALUES, max_size=5))
def test_sampling_params_take_anything_or_name_the_field(fields):
    try:
        params = SamplingParams(**fields)
    except ValueError as e:
        assert str(e).startswith("SamplingParams.")
        return
    assert params.max_tokens >= 1 and 0 <= params.temperature < math.inf


@FUZZ
@given(
    st.one_of(
        VALUES, st.dictionaries(st.sampled_from(["id", "prompt", "messages", *SAMPLING_FIELDS]), VALUES)
    )
)
def test_batch_lines_run_or_are_skipped_with_their_number(obj):
    text = json.dumps(obj, allow_nan=True)
    try:
        request = parse_line(7, text, {}, 0)
    except LineError as e:
        assert e.line_no == 7 and str(e).startswith("line 7: ")
        return
    assert request.key == str(obj["id"])


def _section(keys: list[str], values: st.SearchStrategy) -> st.SearchStrategy:
    return st.dictionaries(st.sampled_from(keys), values, max_size=3)


COUNTS = st.one_of(st.integers(-5, 2**64), SCALARS)
DEPLOY_KEYS = {
    "model": st.sampled_from(
        [str(MODELS / "tiny-v3.json"), str(MODELS / "deepseek-v3-671b.json"), "nowhere"]
    ),
    "dtype": st.sampled_from(["auto", "bfloat16", "fp8", "float32", "int3", 8]),
    "parallel": _section(["tp", "dp", "pp", "ep", "xp"], COUNTS),
    "engine": _section(["max_model_len", "max_num_seqs", "block_size", "seed", "bogus"], COUNTS),
    "cluster": _section(
        ["backend", "nodes", "devices_per_node", "device", "device_memory_gb", "address"], VALUES
    ),
    "job": st.one_of(
        VALUES, st.fixed_dictionaries({"mode": st.sampled_from(["chat", "batch", "serve", "x"])})
    ),
    "server": _section(["port", "host", "max_queue", "api_key"], VALUES),
}
REQUEST_KEYS = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "stop",
    "n",
    "logprobs",
    "top_logprobs",
    "stream",
    "seed",
]


@FUZZ
@given(st.fixed_dictionaries({}, optional=DEPLOY_KEYS))
def test_deployment_files_load_and_plan_or_say_what_is_wrong(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("fuzz") / "deploy.yaml"
    path.write_text(yaml.safe_dump(raw, allow_unicode=True))
    try:
        cfg = load_deploy_config(path)
    except DeployConfigError as e:
        assert str(path) in str(e) or "deployment file" in str(e)
        return
    try:
        build_plan(cfg)
    except (DeployConfigError, LayoutError, ValueError, FileNotFoundError) as e:
        assert str(e)


@FUZZ
@given(st.one_of(VALUES, st.dictionaries(st.sampled_from(REQUEST_KEYS), VALUES)))
@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_request_bodies_parse_or_get_a_400_naming_the_field(model, body):
    try:
        parse_body(model, body)
    except APIError as e:
        assert e.status == 400 and str(e)
