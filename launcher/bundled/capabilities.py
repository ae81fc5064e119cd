"""The line a chat with the bundled model opens with: what it can do, since it can do little else.

A checkpoint of the task family carries MARKER in its config.json (written by train_small); any other
checkpoint gets no line.
"""

from __future__ import annotations

import json
from pathlib import Path

MARKER = "moelaunch_bundled_task_family"
LINE = (
    "The bundled model (a 4M-parameter DeepSeek-V3 in miniature) adds and subtracts numbers up to 999, "
    "reverses a word of up to 12 letters, sorts 2-8 numbers up to 999 and counts a letter in a word; "
    "anything else gets one fixed reply. Reversing and sorting are mostly right, sums, differences and "
    "counts less than half the time (docs/benchmarks.md). Try 'Reverse DeepSeek', 'Sort 9 3 77 1 50', "
    "'What is 123+456?' or 'How many a in banana?'."
)


def is_task_family(model_path: str | Path) -> bool:
    config = Path(model_path) / "config.json"
    try:
        return bool(json.loads(config.read_text()).get(MARKER, False))
    except (OSError, ValueError):
        return False


def capabilities_line(model_path: str | Path) -> str | None:
    return LINE if is_task_family(model_path) else None
