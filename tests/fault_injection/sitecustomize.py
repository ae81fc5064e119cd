"""Fault injection for tests/test_faults.py, loaded by every Python process of a job whose PYTHONPATH
holds this folder (Python imports `sitecustomize` at start-up).

MOELAUNCH_TEST_FAULT="POINT:RANK[:N]" makes rank RANK (its RANK variable) fail at POINT:
  load     SIGKILL itself while reading its first checkpoint tensor
  prefill  SIGKILL itself at the start of its first step that holds a prompt chunk
  decode   SIGKILL itself at the start of its (N+1)-th step of single-token chunks
  slow     sleep N seconds at the start of its first step (a rank slower than the collective timeout)
Processes of other ranks, and the launcher itself, are left alone. With MOELAUNCH_TEST_FAULT_STAMP set,
the faulty rank writes the time (time.time()) it acts into that file, so a test can time the detection.
"""

from __future__ import annotations

import os
import signal
import time


def _stamp() -> None:
    path = os.environ.get("MOELAUNCH_TEST_FAULT_STAMP")
    if path:
        with open(path, "w") as f:
            f.write(repr(time.time()))


def _install(point: str, rank: str, n: float) -> None:
    if os.environ.get("RANK", "0") != rank:
        return
    if point == "load":
        from moelaunch.model.checkpoint import CheckpointReader

        read = CheckpointReader.read

        def read_then_die(self, *args, **kwargs):
            _stamp()
            os.kill(os.getpid(), signal.SIGKILL)
            return read(self, *args, **kwargs)

        CheckpointReader.read = read_then_die
        return

    from moelaunch.engine.model_runner import ModelRunner

    step = ModelRunner.step
    decode_steps = []

    def faulty_step(self, plan):
        prefill = any(c.length > 1 for c in plan)
        if point == "prefill" and prefill:
            _stamp()
            os.kill(os.getpid(), signal.SIGKILL)
        if point == "decode" and plan and not prefill:
            decode_steps.append(1)
            if len(decode_steps) > n:
                _stamp()
                os.kill(os.getpid(), signal.SIGKILL)
        if point == "slow" and plan:
            _stamp()
            time.sleep(n)
            ModelRunner.step = step
        return step(self, plan)

    ModelRunner.step = faulty_step


_fault = os.environ.get("MOELAUNCH_TEST_FAULT")
if _fault:
    _point, _rank, *_rest = _fault.split(":")
    _install(_point, _rank, float(_rest[0]) if _rest else 0.0)
