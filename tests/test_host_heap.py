"""The engine's host-memory policy (engine/host_heap.py): between ordinary steps a freed multi-MB buffer
is reused from the heap without fresh pages; a step of a long prompt starts from a trimmed heap and maps
every buffer from 1 MiB on its own, as before (what that does to resident memory is measured by
benchmarks/long_context.py, docs/benchmarks.md)."""

from __future__ import annotations

import resource
import statistics

import torch

from moelaunch.engine import host_heap
from moelaunch.engine.host_heap import HostHeap, long_prompt
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.engine.scheduler import ScheduledChunk
from moelaunch.engine.sequence import Sequence
from moelaunch.model.prefill_attention import KEY_SEGMENT

BUFFER_PAGES = 2048  # an 8 MiB buffer: a prompt step's activation on the bench model


def _faults_per_buffer() -> float:
    """The median page faults of allocating an 8 MiB buffer, writing it whole and freeing it (the first
    two left out: the heap may grow once more before it holds one)."""
    faults = []
    for _ in range(7):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(BUFFER_PAGES * 1024).fill_(1.0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return statistics.median(faults[2:])


def test_buffers_of_ordinary_steps_are_reused_without_fresh_pages():
    """Under glibc's defaults as the engine had them (own mappings from 1 MiB) an 8 MiB buffer faults in
    all its 2,048 pages on every allocation."""
    HostHeap().before_step(long_prompt=False)
    assert _faults_per_buffer() < BUFFER_PAGES / 10


class _RecordingLibc:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


def test_each_mode_sets_its_thresholds_once_and_a_long_prompt_starts_from_a_trimmed_heap(monkeypatch):
    libc = _RecordingLibc()
    monkeypatch.setattr(host_heap, "_glibc", lambda: libc)
    heap = HostHeap()
    ordinary = [("mallopt", -3, 32 << 20), ("mallopt", -1, 64 << 20)]
    long = [("malloc_trim", 0), ("mallopt", -3, 1 << 20), ("mallopt", -1, 128 << 10)]
    expected = []
    for mode, calls in ((False, ordinary), (False, []), (True, long), (True, []), (False, ordinary)):
        heap.before_step(long_prompt=mode)
        expected += calls
    assert libc.calls == expected


def test_long_prompt_steps_are_the_prompt_chunks_of_prompts_past_one_key_segment():
    def chunk(prompt_len: int, start: int, length: int) -> ScheduledChunk:
        seq = Sequence(0, "r", 0, list(range(prompt_len)), SamplingParams(), seed=0)
        return ScheduledChunk(seq, start, length)

    assert long_prompt(chunk(KEY_SEGMENT + 1, 0, 2048))
    assert long_prompt(chunk(KEY_SEGMENT + 1, KEY_SEGMENT, 1))  # its last prompt token
    assert not long_prompt(chunk(KEY_SEGMENT, 0, 2048))
    assert not long_prompt(chunk(KEY_SEGMENT + 1, KEY_SEGMENT + 1, 1))  # decoding after it
