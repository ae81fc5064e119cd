"""Reading the text files a user points at (deployment YAML, prompts, config.json, tokenizer files): one
error that names the file and what is wrong with it, whatever is wrong."""

from __future__ import annotations

from pathlib import Path


def read_text(path: Path, what: str) -> str:
    """The file's text; ValueError naming `what` and the path when it is missing, a directory,
    unreadable, or not UTF-8 (a binary file given by mistake)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path}: is a directory; give a file") from None
    except PermissionError:
        raise ValueError(f"{what} {path}: not readable by this user (permission denied)") from None
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot be read ({e.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{what} {path}: not UTF-8 text (byte {e.start} is 0x{data[e.start]:02x}); is it the right file?"
        ) from None
