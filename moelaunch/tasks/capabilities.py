"""The line a chat with the bundled model opens with: what it can do, since it can do little else.

A checkpoint of the task family carries MARKER in its config.json (written by its trainer); any other
checkpoint gets no line. The line says what the model is trained to do, not how well it does it: that is
measured by `launch eval` on the checkpoint itself.
"""

from __future__ import annotations

import json
from pathlib import Path

MARKER = "moelaunch_bundled_task_family"
LINE = (
    "The bundled model (a 4M-parameter DeepSeek-V3 in miniature) adds and subtracts numbers up to 999, "
    "reverses a word of up to 12 letters, sorts 2-8 numbers up to 999 and counts a letter in a word; "
    "anything else gets one fixed reply. It works sums, differences and counts out in a hidden think "
    "section first. Try 'What is 123+456?', 'Reverse DeepSeek', 'Sort 9 3 77 1 50' or "
    "'How many a in banana?'."
)


def is_task_family(model_path: str | Path) -> bool:
    config = Path(model_path) / "config.json"
    try:
        return bool(json.loads(config.read_text()).get(MARKER, False))
    except (OSError, ValueError):
        return False


def capabilities_line(model_path: str | Path) -> str | None:
    return LINE if is_task_family(model_path) else None
