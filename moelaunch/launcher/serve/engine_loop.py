"""The engine on its own thread, fed by the HTTP handlers on the event loop.

The engine is not thread-safe and its steps block, so one thread owns it and runs the jobs' drive loop
(launcher/jobs/drive.py) over a live source: the submissions, aborts and health pings the handlers put
in an inbox. Concurrent requests land in the same engine steps (continuous batching). While nothing
runs, the thread sends a keepalive every keepalive_s so the other ranks' collective timeout never
fires on a quiet server. Each request's progress goes back to its handler as an immutable snapshot
(the engine keeps mutating its own output objects).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from moelaunch.engine.drive import Request, drive
from moelaunch.engine.outputs import RequestOutput
from moelaunch.engine.stats import EngineStats

STATS_EVERY_S = 0.5


class QueueFull(RuntimeError):
    """More requests outstanding than the running batches plus server.max_queue."""


class EngineFailed(RuntimeError):
    """The engine (or one of its ranks) failed; nothing more can run."""


@dataclass(frozen=True)
class ChoiceProgress:
    index: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    text: str  # the final text (stop strings cut), once finished
    top_logprobs: tuple[dict[int, float], ...]
    token_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Progress:
    request_id: str
    prompt_tokens: int
    choices: tuple[ChoiceProgress, ...]
    finished: bool


def snapshot(out: RequestOutput) -> Progress:
    choices = tuple(
        ChoiceProgress(
            c.index,
            tuple(c.token_ids),
            c.finish_reason,
            c.text if out.finished else "",
            tuple(c.logprobs or ()),
            tuple(c.token_logprobs or ()),
        )
        for c in out.outputs
    )
    return Progress(out.request_id, len(out.prompt_token_ids), choices, out.finished)


class OutputStream:
    """Progress of one HTTP call's requests, delivered on the event loop; an exception ends it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Progress | Exception] = asyncio.Queue()

    def put(self, item: Progress | Exception) -> None:  # from the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> Progress:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item


@dataclass(frozen=True)
class _Submit:
    request: Request
    stream: OutputStream


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Ping:
    reply: Callable[[], None]


_STOP = object()


class EngineLoop:
    def __init__(
        self,
        engine,
        capacity: int,
        keepalive_s: float,
        on_progress: Callable[[Progress], None] = lambda progress: None,
        on_stats: Callable[[EngineStats], None] = lambda stats: None,
    ) -> None:
        """capacity: requests outstanding at most (running batches + queue). On the engine thread,
        on_progress sees every snapshot and on_stats the engine's stats, at most every STATS_EVERY_S."""
        self.engine = engine
        self.capacity = capacity
        self.keepalive_s = keepalive_s
        self.on_progress = on_progress
        self.on_stats = on_stats
        self._stats_at = 0.0
        self.failure: BaseException | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, OutputStream] = {}  # engine thread only
        self._outstanding = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, requests: list[Request], stream: OutputStream) -> None:
        """Queue an HTTP call's requests (all or none); their progress goes to `stream`."""
        if self.failure is not None:
            raise EngineFailed(f"the engine failed: {self.failure}")
        with self._lock:
            if self._outstanding + len(requests) > self.capacity:
                raise QueueFull(f"{self._outstanding} requests outstanding (capacity {self.capacity})")
            self._outstanding += len(requests)
        for r in requests:
            self._inbox.put(_Submit(r, stream))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def ping(self, timeout_s: float) -> bool:
        """Whether the engine thread answers within timeout_s (it does between steps)."""
        if self.failure is not None or not self._thread.is_alive():
            return False
        loop = asyncio.get_running_loop()
        answered = loop.create_future()
        self._inbox.put(_Ping(lambda: loop.call_soon_threadsafe(_set_done, answered)))
        try:
            await asyncio.wait_for(answered, timeout_s)
        except TimeoutError:
            return False
        return True

    def stop(self, timeout_s: float) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout_s)

    # ---- the engine thread ----
    def _run(self) -> None:
        try:
            for outputs in drive(self.engine, self._source(), on_refused=self._refused):
                for out in outputs:
                    self._deliver(snapshot(out))
                # Always after the step that emptied the engine: an idle server's gauges must read 0.
                self._report_stats(force=not self._streams)
        except BaseException as e:  # noqa: BLE001 - any failure ends serving: every waiting client hears it
            self.failure = e
            for stream in set(self._streams.values()):
                stream.put(EngineFailed(f"the engine failed: {e}"))
            self._streams.clear()

    def _source(self) -> Iterator[Request | None]:
        """The live request source drive() reads on this thread: None means 'nothing new now'."""
        aborted: set[str] = set()
        while True:
            busy = self.engine.has_unfinished()
            try:
                item = self._inbox.get(block=not busy, timeout=None if busy else self.keepalive_s)
            except queue.Empty:
                if busy:
                    yield None
                else:
                    self.engine.keepalive()
                    self._report_stats()
                continue
            if item is _STOP:
                return
            if isinstance(item, _Ping):
                item.reply()
            elif isinstance(item, _Abort):
                if item.request_id in self._streams:
                    self.engine.abort(item.request_id)
                else:  # still in the inbox behind this abort, or already done
                    aborted.add(item.request_id)
            elif item.request.request_id in aborted:
                aborted.discard(item.request.request_id)
                self._release_slot()
            else:
                self._streams[item.request.request_id] = item.stream
                yield item.request

    def _report_stats(self, force: bool = False) -> None:
        # Rate-limited: through the Ray backend each read is a call to rank 0's actor.
        now = time.monotonic()
        if force or now - self._stats_at >= STATS_EVERY_S:
            self._stats_at = now
            self.on_stats(self.engine.stats)

    def _refused(self, request: Request, error: ValueError) -> None:
        self._streams.pop(request.request_id).put(error)
        self._release_slot()

    def _deliver(self, progress: Progress) -> None:
        self.on_progress(progress)
        stream = self._streams.get(progress.request_id)
        if progress.finished:
            self._streams.pop(progress.request_id, None)
            self._release_slot()
        if stream is not None:
            stream.put(progress)

    def _release_slot(self) -> None:
        with self._lock:
            self._outstanding -= 1


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(True)
