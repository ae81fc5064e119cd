"""The README's Python example runs as written, from the repository root, on the bundled model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_python_api_example_runs_as_written():
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Python API") :]
    example = section[section.index("```python\n") + len("```python\n") :].split("```")[0]
    done = subprocess.run(
        [sys.executable, "-c", example], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()[-2:]
    assert first.split() == ["46", "stop"]  # 12+34, through the chat template
    assert second.strip()  # the raw continuation: some text
