"""`launch` on the bundled model as a new user meets it: a line saying what the model can do, then right
answers to what people type, later turns of the same conversation included. Another checkpoint's chat
opens without that line."""

from __future__ import annotations

import subprocess
import sys

from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.launcher.bundled.capabilities import LINE

# The questions of the issue that asked for this, in one conversation, and what a person expects.
TYPED = {
    "What is 123+456?": "579",
    "Reverse DeepSeek": "keeSpeeD",
    "Sort 9 3 77 1 50": "1 3 9 50 77",
    "what's 12 + 34": "46",
    "What is 50-8?": "42",
    "In banana, count a": "3",
    "Who are you?": "I can add, subtract, reverse, sort and count letters.",
}


def launch(*args: str, stdin: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moelaunch.launcher.cli", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=180)


def test_bundled_chat_says_what_it_can_do_and_answers_every_turn():
    done = launch(stdin="".join(f"{q}\n" for q in TYPED))  # the embedded default: chat on the bundled model
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == LINE
    replies = {q: lines[lines.index(f">>> {q}") + 1] for q in TYPED}
    assert replies == TYPED


def test_another_checkpoint_gets_no_such_line(tmp_path):
    checkpoint = add_byte_tokenizer(make_hf_model(tmp_path / "ckpt", "v3", num_hidden_layers=2))
    deploy = tmp_path / "deploy.yaml"
    cluster = "{backend: local, nodes: 1, devices_per_node: 1, device: cpu}"
    deploy.write_text(f"model: {checkpoint}\ncluster: {cluster}\njob: {{mode: chat, max_tokens: 2}}\n")
    done = launch(str(deploy), stdin="hello\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == ">>> hello" and LINE not in done.stdout
