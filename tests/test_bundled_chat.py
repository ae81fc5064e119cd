"""`launch` on the bundled model as a new user meets it: a line saying what the model can do, then one
reply per typed line, each the engine's answer to the whole conversation so far (the chat keeps the
history, as the API's messages do). Another checkpoint's chat opens without that line."""

from __future__ import annotations

import subprocess
import sys

from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.engine.llm import LLM
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT, GREEDY
from moelaunch.tasks.capabilities import LINE
from moelaunch.tasks.tasks import OUT_OF_SCOPE
from moelaunch.text.reasoning import split_reasoning

# The questions of the issue that asked for this, typed into one conversation.
TYPED = (
    "What is 123+456?",
    "Reverse DeepSeek",
    "Sort 9 3 77 1 50",
    "what's 12 + 34",
    "What is 50-8?",
    "In banana, count a",
    "Who are you?",
)
RIGHT = ("579", "keeSpeeD", "1 3 9 50 77", "46", "42", "3", OUT_OF_SCOPE)


def launch(*args: str, stdin: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moelaunch.launcher.cli", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=180)


def test_bundled_chat_says_what_it_can_do_and_answers_every_turn_in_context():
    done = launch(stdin="".join(f"{q}\n" for q in TYPED))  # the embedded default: chat on the bundled model
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == LINE
    replies = [lines[lines.index(f">>> {q}") + 1] for q in TYPED]
    # The same conversation through the API, turn by turn, after the model's own earlier replies.
    expected, messages = [], []
    with LLM(str(DEFAULT_CHECKPOINT)) as llm:
        for q in TYPED:
            messages.append({"role": "user", "content": q})
            text = llm.chat([messages], GREEDY)[0].outputs[0].text
            messages.append({"role": "assistant", "content": text})
            expected.append(
                split_reasoning(text)[1].strip()
            )  # the chat prints the answer, not the think section
    assert replies == expected
    assert replies == list(RIGHT)  # the shipped model gets every one of them right


def test_another_checkpoint_gets_no_such_line(tmp_path):
    checkpoint = add_byte_tokenizer(make_hf_model(tmp_path / "ckpt", "v3", num_hidden_layers=2))
    deploy = tmp_path / "deploy.yaml"
    cluster = "{backend: local, nodes: 1, devices_per_node: 1, device: cpu}"
    deploy.write_text(f"model: {checkpoint}\ncluster: {cluster}\njob: {{mode: chat, max_tokens: 2}}\n")
    done = launch(str(deploy), stdin="hello\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == ">>> hello" and LINE not in done.stdout
