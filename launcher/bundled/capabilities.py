"""The line a chat with the bundled model opens with: what it can do, since it can do little else.

A checkpoint of the task family carries MARKER in its config.json (written by train_small); any other
checkpoint gets no line.
"""

from __future__ import annotations

import json
from pathlib import Path

MARKER = "moelaunch_bundled_task_family"
LINE = (
    "The bundled model answers one question at a time (/clear between them): it adds and subtracts numbers "
    "up to 99, reverses a lowercase word of 3-6 letters, sorts 3-4 numbers below 100 and counts a letter "
    "in a 6-letter word. Try 'What is 12+34?', 'Reverse hello', 'Sort 42 7 19' or 'In banana, count a'."
)


def is_task_family(model_path: str | Path) -> bool:
    config = Path(model_path) / "config.json"
    try:
        return bool(json.loads(config.read_text()).get(MARKER, False))
    except (OSError, ValueError):
        return False


def capabilities_line(model_path: str | Path) -> str | None:
    return LINE if is_task_family(model_path) else None
