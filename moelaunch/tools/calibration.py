"""Calibration prompts as token ids: from a file, or drawn from the bundled task generator.

A file holds one prompt a line (a user turn), or JSON lines with {"prompt": "..."} (a user turn) or
{"messages": [...]} (a whole conversation, e.g. with the assistant's answers). Each is rendered with
the checkpoint's chat template, the way the model is asked.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import jinja2

from moelaunch.tasks.problem_sets import training_conversations
from moelaunch.text.files import read_text
from moelaunch.text.tokenizer import Message, Tokenizer
from moelaunch.training.small_model.data import encode

DEFAULT_PROMPTS = 256


def read_conversations(file: str | Path) -> list[list[Message]]:
    """The file's prompts as chat turns; one clear error for a line that is neither form."""
    path = Path(file)
    conversations = []
    for n, line in enumerate(read_text(path, "prompt file").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            conversations.append([{"role": "user", "content": line}])
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from e
        if isinstance(record, dict) and _is_conversation(record.get("messages")):
            conversations.append(record["messages"])
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
            conversations.append([{"role": "user", "content": record["prompt"]}])
        else:
            raise ValueError(
                f'{path}:{n}: expected {{"prompt": "..."}} or {{"messages": [{{"role": "...", "content": '
                '"..."}, ...]}'
            )
    if not conversations:
        raise ValueError(f"prompt file {path} holds no prompts")
    return conversations


def _is_conversation(messages: object) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def generated_sequences(tok: Tokenizer, n: int, seed: int) -> list[list[int]]:
    """n training problems of the bundled task family with their whole replies, think sections
    included, as the model writes them (never held-out ones)."""
    return [encode(tok, c)[0] for c in itertools.islice(training_conversations(seed, max_turns=1), n)]


def encode_conversation(tok: Tokenizer, messages: list[Message]) -> list[int]:
    # A conversation ending on a user turn is a question: render it as asked, ready for the answer.
    return tok.encode_chat(messages, add_generation_prompt=messages[-1].get("role") != "assistant")


def calibration_sequences(
    model_dir: str | Path, file: str | Path | None = None, n: int = DEFAULT_PROMPTS, seed: int = 0
) -> list[list[int]]:
    """Token ids of the calibration prompts: the file's, or n from the bundled task generator."""
    tok = Tokenizer.from_dir(model_dir)
    if file is None:
        return generated_sequences(tok, n, seed)
    sequences = []
    for n, conversation in enumerate(read_conversations(file), 1):
        try:
            sequences.append(encode_conversation(tok, conversation))
        except jinja2.TemplateError as e:  # e.g. a role the checkpoint's template does not know
            raise ValueError(
                f"prompt file {file}: conversation {n}: the chat template refused it ({e})"
            ) from None
    return sequences
