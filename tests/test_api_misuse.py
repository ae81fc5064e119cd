"""The Python API used wrongly: an empty prompt, a chat role the template does not know, an LLM used
after shutdown, and shutdown after a worker rank died. Each is one clear error (or none), never a
template's or gloo's exception, and never a second error for a failure already reported."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.cluster.errors import ClusterError
from moelaunch.launcher import LLM, SamplingParams

SHORT = SamplingParams(temperature=0, max_tokens=3)
BUNDLED = Path(__file__).resolve().parents[1] / "checkpoints/small"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(
        add_byte_tokenizer(make_hf_model(tmp_path_factory.mktemp("misuse"), "v3", num_hidden_layers=2))
    )


def test_bad_prompts_name_what_is_wrong():
    with LLM(str(BUNDLED), kv_cache_memory=2_000_000) as llm:  # its template refuses unknown roles
        with pytest.raises(ValueError, match="the prompt is empty: give some text"):
            llm.generate("", SHORT)
        with pytest.raises(ValueError, match="chat template refused these messages"):
            llm.chat([{"role": "wizard", "content": "hi"}], SHORT)
        assert llm.generate("hi", SHORT)[0].outputs[0].token_ids  # nothing above broke the engine


def test_an_llm_used_after_shutdown_says_so(checkpoint):
    llm = LLM(checkpoint, kv_cache_memory=2_000_000)
    llm.shutdown()
    with pytest.raises(ValueError, match="this LLM was shut down"):
        llm.generate("hi", SHORT)
    llm.shutdown()  # a second shutdown does nothing


@pytest.mark.slow
def test_shutdown_after_a_worker_died_raises_nothing_more(checkpoint):
    with LLM(checkpoint, tp=2, kv_cache_memory=2_000_000, timeout_s=30) as llm:
        llm._workers[0].kill()
        with pytest.raises(ClusterError, match="rank 1"):
            llm.generate("hello world", SHORT)
        llm.shutdown()  # the death was reported above; shutting down is quiet
    # and leaving the `with` block (a second shutdown) raised nothing either


def test_numpy_scalars_are_numbers_and_wrong_kinds_are_refused():
    import numpy as np

    params = SamplingParams(temperature=np.float32(0.5), max_tokens=np.int64(3), ignore_eos=np.bool_(True))
    assert (params.temperature, params.max_tokens, params.ignore_eos) == (0.5, 3, True)
    with pytest.raises(ValueError, match="ignore_eos='yes': must be a valid boolean"):
        SamplingParams(ignore_eos="yes")
    with pytest.raises(ValueError, match=r"stop_token_ids=\[1.5\] item 0: must be a valid integer"):
        SamplingParams(stop_token_ids=[1.5])
