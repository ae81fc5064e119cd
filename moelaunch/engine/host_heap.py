"""How the engine's process keeps host memory between steps (CPU, glibc): a step's buffers come from the
heap, reused by the next step without fresh pages, while resident memory still follows the plan's live
figures.

By default glibc maps each buffer above a threshold on its own and unmaps it at free: the multi-MB
activations of a prompt step then arrive as fresh pages the kernel faults in and zeroes on every step
(113K faults and about a quarter of a 2048-token bf16 prompt step on the bench model). The exception is a step
with a chunk of a long prompt (past one key segment of prefill attention): its buffers grow from chunk
to chunk with the keys attended, and reused heap holes let resident memory creep past what is live
(+16 % at 32K tokens, measured), so there every buffer from 1 MiB has its own mapping, returned at free,
as under glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

from moelaunch.engine.scheduler import ScheduledChunk
from moelaunch.model.prefill_attention import KEY_SEGMENT

# glibc's mallopt parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Buffers from this size up get their own mapping: glibc's ceiling for its dynamic threshold (fixed
# here, so that it stays put), and in long-prompt steps 1 MiB.
OWN_MAPPING_FROM = 32 << 20
OWN_MAPPING_FROM_LONG_PROMPT = 1 << 20
# The free bytes at the heap's top that glibc keeps for the next step's buffers (beyond: returned at
# free); in long-prompt steps glibc's default.
HEAP_SLACK = 64 << 20
HEAP_SLACK_LONG_PROMPT = 128 << 10


@cache
def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (mallopt, malloc_trim), else None: another keeps its own policy."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


class HostHeap:
    """The thresholds above, set before each step (the engine's process; a no-op where the C library
    is not glibc)."""

    def __init__(self) -> None:
        self._libc = _glibc()
        self._long_prompt: bool | None = None  # the mode the last step ran in

    def before_step(self, long_prompt: bool) -> None:
        """Switch modes when the coming step's differs; entering the long-prompt mode first gives the
        heap's free pages back, so that the earlier steps' buffers do not sit beside its own."""
        libc = self._libc
        if libc is None or long_prompt == self._long_prompt:
            return
        if long_prompt:
            libc.malloc_trim(0)
            libc.mallopt(_M_MMAP_THRESHOLD, OWN_MAPPING_FROM_LONG_PROMPT)
            libc.mallopt(_M_TRIM_THRESHOLD, HEAP_SLACK_LONG_PROMPT)
        else:
            libc.mallopt(_M_MMAP_THRESHOLD, OWN_MAPPING_FROM)
            libc.mallopt(_M_TRIM_THRESHOLD, HEAP_SLACK)
        self._long_prompt = long_prompt


def long_prompt(chunk: ScheduledChunk) -> bool:
    """Whether a step's chunk belongs to a prompt longer than one key segment of prefill attention."""
    prompt = len(chunk.seq.prompt)
    return chunk.start < prompt and prompt > KEY_SEGMENT
