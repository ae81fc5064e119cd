"""A checkpoint with a NaN weight once ran to the end with every token 0: `launch batch` exited 0,
`launch prune` wrote a NaN copy, `launch eval` reported accuracy 0 with MTP acceptance 1.0. Now the
first non-finite logits end that request with an error naming the cause (the engine serves the
others), and prune refuses such a checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file
from serve_process import served
from tiny_models import add_byte_tokenizer, add_mtp_layer, make_hf_model

from moelaunch.cluster.rendezvous import free_port
from moelaunch.engine.drive import run_to_completion
from moelaunch.engine.llm import LLM
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.launcher.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KV = 4_000_000
GREEDY = SamplingParams(temperature=0, max_tokens=4)
GOOD_PROMPT = [5, 6, 7, 8]
HEAD = "lm_head.weight"  # a NaN there: every row of logits holds one
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    path = make_hf_model(tmp_path_factory.mktemp("healthy"), "v3", num_hidden_layers=2)
    return add_mtp_layer(add_byte_tokenizer(path))


@pytest.fixture(scope="module")
def expected(healthy) -> list[int]:
    with LLM(str(healthy), kv_cache_memory=KV) as llm:
        return llm.generate([GOOD_PROMPT], GREEDY)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def bad_token(expected) -> int:
    """A token the good prompt never meets: its embedding row is the one made NaN."""
    return next(t for t in range(4, 300) if t not in GOOD_PROMPT + expected)


def broken(src: Path, dst: Path, name: str, row: int = 0) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors[name][row, 0] = float("nan")
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_a_nan_weight_fails_its_requests_naming_it_and_the_engine_serves_on(
    healthy, expected, bad_token, tmp_path, speculative
):
    """A NaN in one token's embedding: prompts with that token fail at their first step, the others
    (in the same batches) give the healthy checkpoint's tokens; with MTP drafts too, whose verify
    never takes the failed row's marker for a token."""
    bad = broken(healthy, tmp_path / "bad", EMBED, bad_token)
    with LLM(str(bad), kv_cache_memory=KV, speculative=speculative) as llm:
        llm.engine.add_request("bad", [5, bad_token, 7], GREEDY)
        llm.engine.add_request("good", GOOD_PROMPT, GREEDY)
        done = run_to_completion(llm.engine)
        failed, served = done["bad"].outputs[0], done["good"].outputs[0]
        assert failed.finish_reason == "error" and failed.token_ids == []
        assert "non-finite logits" in failed.error and EMBED in failed.error
        assert served.finish_reason == "length" and served.token_ids == expected
        with pytest.raises(ValueError, match=f"prompt 1 .*non-finite logits.*{EMBED}"):
            llm.generate([GOOD_PROMPT, [bad_token]], GREEDY)
        assert llm.generate([GOOD_PROMPT], GREEDY)[0].outputs[0].token_ids == expected


def test_every_rank_of_a_tp_2_engine_ends_the_request_alike(healthy, tmp_path):
    """The tokens rank 0 sends the other ranks carry the failed row's marker (not dropped as padding),
    so all ranks end the request together and keep serving."""
    bad = broken(healthy, tmp_path / "bad", HEAD)
    with LLM(str(bad), tp=2, kv_cache_memory=KV, timeout_s=60) as llm:
        for _ in range(2):
            with pytest.raises(ValueError, match="non-finite logits"):
                llm.generate([GOOD_PROMPT], GREEDY)


def write_jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    return path


def test_launch_batch_fails_the_lines_and_exits_1(healthy, tmp_path, capsys):
    bad = broken(healthy, tmp_path / "bad", HEAD)
    inp, out = write_jsonl(tmp_path / "in.jsonl", ["hi", "there"]), tmp_path / "out.jsonl"
    args = ["batch", "--model", str(bad), "--input", str(inp), "--output", str(out), "--max-tokens", "4"]
    assert main([*args, "--kv-cache-memory", str(KV), "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert f"{inp}:1: failed: the model produced non-finite logits" in captured.err and HEAD in captured.err
    assert "0 done" in captured.out and "2 line(s) failed: 1, 2" in captured.out
    assert not out.exists() or out.read_text() == ""  # nothing written: a rerun runs them again


@pytest.mark.parametrize("method", [["--sparsity", "0.5"], ["--experts", "4"], ["--heads", "1"]])
def test_launch_prune_refuses_a_checkpoint_with_nan_weights(healthy, tmp_path, capsys, method):
    bad = broken(healthy, tmp_path / "bad", "model.layers.1.mlp.experts.0.up_proj.weight")
    out = tmp_path / "pruned"
    assert main(["prune", str(bad), str(out), *method]) == 1
    err = capsys.readouterr().err
    assert "holds NaN or inf values in 1 tensor(s) (model.layers.1.mlp.experts.0.up_proj.weight)" in err
    assert not out.exists() or not any(out.iterdir())


def test_launch_eval_fails_instead_of_reporting_a_score(healthy, tmp_path, capsys):
    """Once: "accuracy 0, MTP acceptance 1.0" (every token 0, every draft 0 and kept)."""
    bad = broken(healthy, tmp_path / "bad", HEAD)
    assert main(["eval", "--model", str(bad), "--n", "4"]) == 1
    captured = capsys.readouterr()
    assert "non-finite logits" in captured.err and HEAD in captured.err
    assert "accuracy=" not in captured.out and "acceptance" not in captured.out


def test_the_server_answers_500_naming_the_cause_and_serves_on(healthy, tmp_path):
    """A whole request is a 500 in OpenAI's shape naming the tensor; a stream ends with an error event;
    the next request is served the same way (the engine did not stop)."""
    bad = broken(healthy, tmp_path / "bad", HEAD)
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {bad}\nengine: {{kv_cache_memory: {KV}}}\nserver: {{port: {port}}}\njob: {{mode: serve}}\n"
    )
    body = {"model": "bad", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with served(config, port) as server:
        for _ in range(2):
            answer = httpx.post(f"{server['url']}/v1/chat/completions", json=body, timeout=60)
            assert answer.status_code == 500, answer.text
            message = answer.json()["error"]["message"]
            assert "non-finite logits" in message and HEAD in message  # the tensor the load warned of
        events = httpx.post(
            f"{server['url']}/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ).text
        assert '"error"' in events and "non-finite logits" in events and "[DONE]" not in events


def test_the_chat_ends_with_the_error_instead_of_empty_replies(healthy, tmp_path, capsys):
    from moelaunch.launcher.jobs.chat import chat_loop

    bad = broken(healthy, tmp_path / "bad", HEAD)
    with LLM(str(bad), kv_cache_memory=KV) as llm:
        with pytest.raises(ValueError, match=f"^the model produced non-finite logits.*{HEAD}"):
            chat_loop(llm.engine, llm.tokenizer, lambda turn: GREEDY, ["hi", "there"])
