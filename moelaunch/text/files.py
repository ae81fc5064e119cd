"""Reading the files a user points at (deployment YAML, prompts, config.json, tokenizer files, weights):
one error that names the file and what is wrong with it, whatever is wrong."""

from __future__ import annotations

import os
from pathlib import Path


def read_text(path: Path, what: str) -> str:
    """The file's text; ValueError naming `what` and the path when it is missing, a directory,
    unreadable, or not UTF-8 (a binary file given by mistake)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise file_error(path, what, e) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{what} {path}: not UTF-8 text (byte {e.start} is 0x{data[e.start]:02x}); is it the right file?"
        ) from None


def check_readable(path: Path, what: str) -> None:
    """Open and close the file: read_text's errors for a file that a library reads later (weights, a
    tokenizer, a prompt file read after the model loads), so they come first and say what is wrong
    (safetensors reports a denied read as "No such file")."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise file_error(path, what, e) from None


def is_missing(path: Path) -> bool:
    """Whether nothing is at path. Not os.path.exists: that says False also for a file this user may not
    see (a directory above it denies search), and "not found" would then blame the wrong thing."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    except OSError:  # e.g. permission denied: something is there, and opening it says what is wrong
        pass
    return False


def file_error(path: Path, what: str, error: OSError) -> ValueError:
    """The ValueError for an OSError met opening `path`: what is wrong and the fix, no errno jargon."""
    if isinstance(error, FileNotFoundError):
        return ValueError(f"{what} {path}: no such file")
    if isinstance(error, IsADirectoryError):
        return ValueError(f"{what} {path}: is a directory; give a file")
    if isinstance(error, PermissionError):
        return ValueError(
            f"cannot read {what} {path}: permission denied (the file, or a directory above it, is not "
            "readable by this user); fix its permissions or run as a user who can read it"
        )
    return ValueError(f"{what} {path}: cannot be read ({error.strerror})")
