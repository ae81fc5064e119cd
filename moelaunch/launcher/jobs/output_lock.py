"""One run at a time per batch output. Two runs appending to one file would each run every id it lacks
and write it twice; so a run holds an exclusive flock on OUTPUT.lock, beside the output, from before its
model loads until it ends. The kernel drops an flock when its process dies, however it dies: a killed
run never leaves the output locked (its OUTPUT.lock file may stay, and is reused)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold the output's lock for the block; ValueError naming the output and the other run's pid when
    another run holds it (no wait: that run may take hours)."""
    path = output.with_name(output.name + ".lock")
    fd = _acquire(path, output)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message a second run gives
        yield
    finally:
        path.unlink(missing_ok=True)  # while still holding it: see _acquire
        os.close(fd)


def _acquire(path: Path, output: Path) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(
                f"{output} is being written by another run (pid {holder}, holding {path}): two runs would "
                "each write every id; wait for that run to end or stop it, or write to another output file"
            ) from None
        # A run that ended removed the file between our open and flock: we hold a lock on a file no one
        # else will open. Take the one now at the path instead.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
