"""Checks on a file a job will write, made before the model loads: a job that can only fail at its
first write should fail in its first second, and lose nothing."""

from __future__ import annotations

import os
from pathlib import Path


def check_writable(path: Path, what: str) -> None:
    """Raise ValueError naming `what` (e.g. "--output") when path cannot be created or appended to."""
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory: give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(
            f"{what} {path}: directory {parent} does not exist; create it or choose another path"
        )
    target = path if path.exists() else parent
    if not os.access(target, os.W_OK):
        raise ValueError(f"{what} {path}: {target} is not writable")
