"""`launch CONFIG.yaml` job modes on the local backend, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.launcher import LLM, SamplingParams
from moelaunch.launcher.deploy.config import load_deploy_config
from moelaunch.launcher.deploy.plan import build_plan
from moelaunch.launcher.jobs.run import DEMO_QUESTIONS, engine_spec
from moelaunch.tasks.capabilities import LINE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return add_byte_tokenizer(make_hf_model(tmp_path_factory.mktemp("jobs"), "v3", num_hidden_layers=2))


def deployment(tmp_path, checkpoint, job: str) -> str:
    path = tmp_path / "deploy.yaml"
    cluster = "{backend: local, nodes: 1, devices_per_node: 1, device: cpu}"
    path.write_text(f"model: {checkpoint}\ncluster: {cluster}\njob: {job}\n")
    return str(path)


def launch(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moelaunch.launcher.cli", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=180)


def test_chat_mode_reads_turns_from_stdin(tmp_path, checkpoint):
    config = deployment(tmp_path, checkpoint, "{mode: chat, max_tokens: 5, temperature: 0}")
    done = launch(config, stdin="hello\n/clear\nhello\n")
    assert done.returncode == 0, done.stderr
    with LLM(str(checkpoint), kv_cache_memory=1_000_000) as llm:
        reply = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=5))
    text = reply[0].outputs[0].text
    assert done.stdout.count(f">>> hello\n{text}\n") == 2  # the same answer after /clear
    assert LINE not in done.stdout  # another checkpoint than the bundled one: no word on its skills


def test_the_default_launch_says_what_the_bundled_model_can_do_and_answers():
    done = launch()  # the README's first command: configs/local.yaml, stdin not a terminal: the demo
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == LINE
    # One conversation: each demo question echoed, then its answer (right answers: test_bundled_chat.py).
    asked = [line for line in lines if line.startswith(">>> ")]
    assert asked == [f">>> {q}" for q in DEMO_QUESTIONS]
    assert all(lines[lines.index(q) + 1].strip() for q in asked)


def test_bench_mode_reports_every_case(tmp_path, checkpoint):
    out = tmp_path / "bench.json"
    job = f"{{mode: bench, num_requests: 3, input_len: 6, output_len: 4, output: {out}}}"
    done = launch(deployment(tmp_path, checkpoint, job))
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["moelaunch"]
    assert set(results) == {"throughput", "latency-b1", "latency-b8", "latency-b64"}
    assert results["latency-b8"]["output_tokens"] == 8 * 4


def test_layout_that_does_not_fit_fails_before_starting_anything(tmp_path, checkpoint):
    done = launch(deployment(tmp_path, checkpoint, "{mode: chat}"), "--set", "parallel.tp=3")
    assert done.returncode == 1
    assert "needs dp*pp*tp" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA GPU")
def test_cuda_on_a_machine_without_one_fails_before_starting_anything(tmp_path, checkpoint):
    cuda = ["--set", "cluster.device=cuda", "--set", "cluster.device_memory_gb=80"]
    done = launch(deployment(tmp_path, checkpoint, "{mode: chat}"), *cuda)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "cluster.device: given 'cuda'" in done.stderr and "here is no CUDA GPU" in done.stderr


def test_the_default_chat_keeps_going_whatever_is_typed():
    """Bytes that are not UTF-8, a 20k-token line and a history past the 512-token context once ended the
    default chat (a traceback, exit 1, and an empty answer then an exit). Now the line that cannot fit is
    refused, the oldest exchanges are forgotten (and the chat says so), and every other turn is answered
    right, in one conversation."""
    sums = [f"What is {i}+{i + 1}?" for i in range(30)]
    stdin = b"Reverse \xff\xfe abc\n" + ("Reverse " + "a" * 20000 + "\n").encode()
    stdin += "".join(f"{q}\n" for q in sums).encode()
    done = subprocess.run(
        [sys.executable, "-m", "moelaunch.launcher.cli"], input=stdin, capture_output=True, timeout=180
    )
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0 and "Traceback" not in err, err
    assert "this model takes at most 256 with room for the reply: shorten it" in out
    assert "the conversation outgrew the model's 512-token context: forgot the oldest" in out
    lines = [line for line in out.splitlines() if not line.startswith("(the conversation outgrew")]
    for i, question in enumerate(sums):
        assert lines[lines.index(f">>> {question}") + 1] == str(2 * i + 1), question


def test_the_engine_gets_the_kv_cache_the_plan_shows(tmp_path, checkpoint):
    """`launch plan`'s KV figure is what the engine allocates: the launcher hands it the plan's budget."""
    config = deployment(tmp_path, checkpoint, "{mode: chat}")
    cfg = load_deploy_config(config, ["engine.max_model_len=64", "engine.kv_cache_fraction=0.00002"])
    plan = build_plan(cfg)
    per_sequence = 64 // cfg.engine.block_size
    assert per_sequence <= plan.kv_blocks < cfg.engine.max_num_seqs * per_sequence  # neither bound decides
    with LLM.from_spec(engine_spec(cfg, plan)) as llm:
        assert llm.engine.blocks.num_blocks == plan.kv_blocks
