"""A one-line summary every few seconds while the engine runs a job: throughput since the last line
and the engine's load (the same figures /metrics exports, for jobs that a person watches in a log)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from moelaunch.engine.stats import EngineStats


class ProgressLog:
    def __init__(self, label: str, interval_s: float, write: Callable[[str], None] | None = None) -> None:
        self.label = label
        self.interval_s = interval_s
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self._since = time.monotonic()
        self._tokens = 0
        self._finished = 0

    def count(self, tokens: int, finished: int) -> None:
        self._tokens += tokens
        self._finished += finished

    def maybe_write(self, read_stats: Callable[[], EngineStats]) -> None:
        """Write the line if interval_s passed; the stats are read only then (a remote call on Ray)."""
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return
        stats = read_stats()
        acceptance = "" if stats.spec_acceptance is None else f", MTP acceptance {stats.spec_acceptance:.0%}"
        self.write(
            f"{self.label}: {self._finished / elapsed:.2f} req/s, "
            f"{self._tokens / elapsed:.1f} tok/s generated; "
            f"running {stats.running}, waiting {stats.waiting}; KV cache {stats.kv_usage:.0%} used, "
            f"prefix hits {stats.prefix_hit_rate:.0%}, {stats.preemptions} preemptions{acceptance}"
        )
        self._since, self._tokens, self._finished = now, 0, 0
