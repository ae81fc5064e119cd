"""The line a chat with the bundled model opens with: what it can do, since it can do little else.

A checkpoint of the task family carries MARKER in its config.json (written by train_small); any other
checkpoint gets no line.
"""

from __future__ import annotations

import json
from pathlib import Path

MARKER = "moelaunch_bundled_task_family"
LINE = (
    "The bundled model adds and subtracts numbers up to 999, reverses a word, sorts up to 8 numbers and "
    "counts a letter in a word: try 'What is 123+456?', 'Reverse DeepSeek', 'Sort 9 3 77 1 50' or "
    "'In banana, count a'."
)


def capabilities_line(model_path: str | Path) -> str | None:
    config = Path(model_path) / "config.json"
    try:
        marked = json.loads(config.read_text()).get(MARKER, False)
    except (OSError, ValueError):
        return None
    return LINE if marked else None
