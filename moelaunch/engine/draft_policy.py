"""When MTP drafting pays: decided on rank 0 from measured decode steps, per batch-size bucket.

A drafting step computes two rows per sequence and runs the MTP layer, so it costs more than a plain
step; it yields 1 + acceptance tokens per sequence instead of 1. Rank 0 times decode-only steps in
which every sequence drafts and steps in which none does, per bucket of the running batch size
(1, 2-3, 4-7, 8-15, ...): drafting pays while (1 + acceptance) / t_draft > 1 / t_plain. A bucket
with no drafting figure yet tries drafting; one with no plain figure yet tries plain; every
RECHECK_STEPS steps the losing side is measured again (the machine's load and the acceptance move).

The decision applies to the sequences admitted next, for their lifetime, and can switch running ones
off (never back on): the MTP layer's own KV cache has a hole wherever its forward was skipped, and
refilling it would need the main model's hidden states at those positions, which are not kept (or the
MTP layer run on every step, the cost the policy is there to save). So a sequence drafts from its
first position until it stops for good. A prompt whose prefix hits blocks cached by a sequence that
was not drafting reads that prefix's holes in the MTP layer: its drafts are then guesses from a
partly wrong context, which lowers its acceptance. Drafts never change the tokens (greedy verification
keeps exactly what plain decoding picks; sampled drafts keep the distribution, though a seeded request
draws differently with drafts than without), only the speed.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

# Step times kept per (bucket, drafting): the fastest of the last WINDOW is the figure. Other work on
# the machine only ever adds time, and comes and goes faster than a side is measured; a median would
# compare one side's busy spell with the other's quiet one (measured: flapping decisions at batch 1).
WINDOW = 32
# Draft tokens verified before the acceptance counts: a sequence's first guesses after a prompt are
# its worst (measured on random prompts: 0.00 over the first 8, 0.54 over whole sequences).
MIN_DRAFTED = 64
MIN_STEPS = 8  # steps measured before a side's figure counts
RECHECK_STEPS = 512  # decode steps in a bucket before the losing side is measured again
# A decision changes only when the other side is this much faster: step times on a busy machine move
# by more than their differences, and each switch-off ends the running sequences' drafts.
HYSTERESIS = 0.05


def batch_bucket(batch: int) -> int:
    """The power of two at or below `batch`: step costs change little within one."""
    return 1 << (batch.bit_length() - 1)


@dataclass
class BucketTimes:
    draft: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    plain: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    steps_since_check: int = 0  # steps since the losing side was last measured
    pays: bool | None = None  # the last decision logged

    def figure(self, drafting: bool) -> float | None:
        times = self.draft if drafting else self.plain
        return min(times) if len(times) >= MIN_STEPS else None


@dataclass
class DraftPolicy:
    """Rank 0's record of decode step times and draft acceptance; `drafts(batch)` is its decision."""

    buckets: dict[int, BucketTimes] = field(default_factory=dict)
    drafted: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW * 8))
    accepted: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW * 8))

    def record(self, batch: int, drafting: bool, seconds: float, drafted: int, accepted: int) -> None:
        """A decode-only step of `batch` sequences, all drafting or none, that took `seconds`."""
        times = self.buckets.setdefault(batch_bucket(batch), BucketTimes())
        (times.draft if drafting else times.plain).append(seconds)
        times.steps_since_check += 1
        if drafting:
            self.drafted.append(drafted)
            self.accepted.append(accepted)

    @property
    def acceptance(self) -> float | None:
        """Kept draft tokens per drafted one over the recent drafting steps."""
        drafted = sum(self.drafted)
        return sum(self.accepted) / drafted if drafted >= MIN_DRAFTED else None

    def drafts(self, batch: int) -> bool:
        """Whether sequences running in a batch of `batch` should draft."""
        times = self.buckets.setdefault(batch_bucket(batch), BucketTimes())
        t_draft, t_plain, acceptance = times.figure(True), times.figure(False), self.acceptance
        if t_draft is None or acceptance is None:
            return True  # measure drafting first
        if t_plain is None:
            return False
        gain = (1 + acceptance) * t_plain / t_draft  # tokens/s with drafts over tokens/s without
        # Keep the standing decision unless the other side wins by HYSTERESIS.
        threshold = {None: 1.0, True: 1 - HYSTERESIS, False: 1 + HYSTERESIS}[times.pays]
        pays = gain > threshold
        if times.steps_since_check >= RECHECK_STEPS:
            times.steps_since_check = 0
            (times.plain if pays else times.draft).clear()  # measure the losing side anew
        if pays != times.pays:
            times.pays = pays
            print(self.reason(batch, pays, t_draft, t_plain, acceptance), file=sys.stderr)
        return pays

    @staticmethod
    def reason(batch: int, pays: bool, t_draft: float, t_plain: float, acceptance: float) -> str:
        with_drafts = batch * (1 + acceptance) / t_draft
        without = batch / t_plain
        bucket = batch_bucket(batch)
        batches = f"{bucket}" if bucket == 1 else f"{bucket}-{2 * bucket - 1}"
        return (
            f"moelaunch: MTP {'on' if pays else 'off'} at batch {batches}: "
            f"{with_drafts:,.0f} tok/s with drafts (acceptance {acceptance:.2f}) vs {without:,.0f} without"
        )
