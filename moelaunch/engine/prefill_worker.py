"""A prefill engine stepped on its own thread, so that a long prompt never holds up a decode step.

Only this thread touches the engine (an LLMEngine is not thread-safe, and a Ray actor runs one call at
a time): the router's calls (add a request, release blocks, abort...) wait in an inbox and run between
steps; each step's outputs, or the error that ended the thread, go to a queue shared by every worker.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from moelaunch.engine.outputs import RequestOutput

IDLE_WAIT_S = 0.5  # an idle worker re-checks for stop this often


class PrefillWorker:
    def __init__(self, engine: Any, index: int, results: queue.Queue) -> None:
        self.engine = engine
        self.index = index
        self.in_flight = 0  # requests on this engine, counted by the router (its stats would wait a step)
        self._inbox: queue.Queue[Callable[[Any], list[RequestOutput] | None] | None] = queue.Queue()
        self._results = results
        self._thread = threading.Thread(target=self._run, name=f"prefill-{index}", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[Any], list[RequestOutput] | None]) -> None:
        """Run call(engine) on the worker's thread before its next step; outputs it returns are queued."""
        self._inbox.put(call)

    def close(self, timeout_s: float) -> None:
        self._inbox.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished()
                try:
                    call = self._inbox.get(timeout=IDLE_WAIT_S) if idle else self._inbox.get_nowait()
                except queue.Empty:
                    call = ...
                if call is None:  # closing: blocks released by the last calls are given back first
                    if self.engine.has_unfinished():
                        self.engine.step()
                    return
                if call is not ...:
                    outputs = call(self.engine)
                    if outputs:
                        self._results.put((self, outputs))
                    continue  # take every queued call before stepping
                if self.engine.has_unfinished():
                    self._results.put((self, self.engine.step()))
        except BaseException as e:  # noqa: BLE001 - the router re-raises it on the caller's thread
            self._results.put((self, e))
