"""`moelaunch.launcher.generate` as users start it: under torchrun on two loopback "nodes" with a c10d
rendezvous, and as an interactive chat driven through a pseudo-terminal."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pexpect
import pytest
from tiny_models import add_byte_tokenizer, make_hf_model

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PROMPTS = ["What is 2+2?", "Reverse the word cat", "hello"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_hf_model(tmp_path_factory.mktemp("tiny"), "v3", num_hidden_layers=4)
    return str(add_byte_tokenizer(path))


def generate_cmd(checkpoint: str, out, extra: list[str]) -> list[str]:
    args = [
        "--ckpt-path",
        checkpoint,
        "--input-file",
        str(out.parent / "prompts.txt"),
        "--output-file",
        str(out),
    ]
    return [
        "-m",
        "moelaunch.launcher.generate",
        *args,
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.7",
        *extra,
    ]


def test_two_torchrun_nodes_with_c10d_rendezvous_match_one_process(checkpoint, tmp_path):
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    single = tmp_path / "single.jsonl"
    subprocess.run([sys.executable, *generate_cmd(checkpoint, single, [])], check=True, timeout=120)
    multi = tmp_path / "multi.jsonl"
    rdzv = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:29655",
    ]
    nodes = [
        subprocess.Popen([*TORCHRUN, *rdzv, *generate_cmd(checkpoint, multi, ["--tp", "2", "--dp", "2"])])
        for _ in range(2)
    ]
    assert [node.wait(timeout=180) for node in nodes] == [0, 0]
    expected = [json.loads(line) for line in single.read_text().splitlines()]
    got = [json.loads(line) for line in multi.read_text().splitlines()]
    assert [g["prompt"] for g in got] == PROMPTS
    assert got == expected


def one_process_reply(checkpoint: str, question: str) -> str:
    from moelaunch.launcher import LLM, SamplingParams

    with LLM(checkpoint, kv_cache_memory=1_000_000) as llm:
        out = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=10))
    return out[0].outputs[0].text


def test_interactive_chat_across_two_ranks(checkpoint):
    question = "What is 2+2?"
    expected = one_process_reply(checkpoint, question)
    args = [
        "--nproc-per-node",
        "2",
        "--master-port",
        "29657",
        "-m",
        "moelaunch.launcher.generate",
        "--ckpt-path",
        checkpoint,
    ]
    args += ["--interactive", "--max-new-tokens", "10", "--temperature", "0", "--dp", "2", "--tp", "1"]
    args += ["--timeout", "6"]  # peers give up after 6 s of silence: the pause below must not kill them
    chat = pexpect.spawn(sys.executable, TORCHRUN[1:] + args, encoding="utf-8", timeout=120)
    chat.expect_exact(">>> ")
    time.sleep(10)  # a person thinking for longer than the collective timeout
    chat.sendline(question)
    chat.expect_exact(">>> ")
    first = chat.before
    chat.sendline("/clear")
    chat.expect_exact(">>> ")
    chat.sendline(question)  # after /clear the model sees the same single-turn chat again
    chat.expect_exact(">>> ")
    second = chat.before
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0
    for transcript in (first, second):
        reply = transcript.replace("\r\n", "\n").split(question, 1)[1].strip("\n")
        assert reply.strip() == expected.strip()  # printed once, by rank 0 only


def test_a_layout_the_model_cannot_split_is_one_line_before_anything_runs(checkpoint, tmp_path):
    (tmp_path / "prompts.txt").write_text("hi\n")
    done = subprocess.run(
        [sys.executable, *generate_cmd(checkpoint, tmp_path / "out.jsonl", ["--tp", "3"])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "is not divisible by tp=3" in done.stderr and "Traceback" not in done.stderr
