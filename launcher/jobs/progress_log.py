"""A one-line summary every few seconds while a job runs: throughput since the last line and the
engine's load (the same figures /metrics exports, for jobs that a person watches in a log)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from moelaunch.launcher.engine.stats import EngineStats


class ProgressLog:
    def __init__(self, label: str, interval_s: float, out: TextIO = sys.stderr) -> None:
        self.label = label
        self.interval_s = interval_s
        self.out = out
        self._since = time.monotonic()
        self._tokens = 0
        self._finished = 0

    def count(self, tokens: int, finished: int) -> None:
        self._tokens += tokens
        self._finished += finished

    def maybe_write(self, stats: EngineStats) -> None:
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return
        acceptance = "" if stats.spec_acceptance is None else f", MTP acceptance {stats.spec_acceptance:.0%}"
        self.out.write(
            f"{self.label}: {self._finished / elapsed:.2f} req/s, "
            f"{self._tokens / elapsed:.1f} tok/s generated; "
            f"running {stats.running}, waiting {stats.waiting}; KV cache {stats.kv_usage:.0%} used, "
            f"prefix hits {stats.prefix_hit_rate:.0%}, {stats.preemptions} preemptions{acceptance}\n"
        )
        self.out.flush()
        self._since, self._tokens, self._finished = now, 0, 0
