"""The engine on its own thread, fed by the HTTP handlers on the event loop.

The engine is not thread-safe and its steps block, so one thread owns it and runs the jobs' drive loop
(launcher/jobs/drive.py) over a live source: the submissions, aborts and health pings the handlers put
in an inbox. Concurrent requests land in the same engine steps (continuous batching). While nothing
runs, the thread sends a keepalive every keepalive_s so the other ranks' collective timeout never
fires on a quiet server. Each request's progress goes back to its handler as an immutable snapshot
(the engine keeps mutating its own output objects).

Fairness: the loop keeps the requests it has not yet handed to the engine in one queue per client and
hands them over in turn across clients, and only while the engine has room (fewer sequences in it than
its running batches hold), so the engine's own first-come queue stays short and a new client's request
starts at the next free slot instead of behind another client's hundreds. A client is the request's
OpenAI `user` field when it gives one, else its HTTP call. Capacity counts sequences (prompts x n).

Stalls: the loop records when the engine thread went into the engine (a step or a keepalive). One that
has not come back within stall_timeout_s (a rank stopped, or too slow) fails the requests waiting on it
and refuses new ones (503) on the server's own clock, long before the collective timeout would; when the
step completes after all, the server serves again.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from moelaunch.engine.drive import Request, drive
from moelaunch.engine.outputs import RequestOutput
from moelaunch.engine.stats import EngineStats

STATS_EVERY_S = 0.5
STALL_POLL_S = 0.25  # how often a waiting handler looks for a stalled or failed engine


class QueueFull(RuntimeError):
    """More sequences outstanding than the running batches plus server.max_queue."""


class EngineFailed(RuntimeError):
    """The engine (or one of its ranks) failed; nothing more can run."""


class Stalled(RuntimeError):
    """The engine has been inside one step for longer than server.stall_timeout_s."""


@dataclass(frozen=True)
class ChoiceProgress:
    index: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    text: str  # the final text (stop strings cut), once finished
    top_logprobs: tuple[dict[int, float], ...]
    token_logprobs: tuple[float, ...]
    error: str | None = None  # finish_reason "error": what went wrong, as the engine said it


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
            c.error,
        )
        for c in out.outputs
    )
    return Progress(out.request_id, len(out.prompt_token_ids), choices, out.finished)


class OutputStream:
    """Progress of one HTTP call's requests, delivered on the event loop; an exception ends it, and so
    does a stalled or failed engine (`check_alive` raises), seen within STALL_POLL_S."""

    def __init__(self, loop: asyncio.AbstractEventLoop, check_alive: Callable[[], None]) -> None:
        self._loop = loop
        self._check_alive = check_alive
        self._queue: asyncio.Queue[Progress | Exception] = asyncio.Queue()

    def put(self, item: Progress | Exception) -> None:  # from the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> Progress:
        while True:
            try:
                item = await asyncio.wait_for(self._queue.get(), STALL_POLL_S)
            except TimeoutError:
                self._check_alive()
                continue
            if isinstance(item, Exception):
                raise item
            return item


@dataclass(frozen=True)
class _Submit:
    request: Request
    stream: OutputStream
    client: str


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
        room: int,
        max_queue: int,
        keepalive_s: float,
        stall_timeout_s: float,
        on_progress: Callable[[Progress], None] = lambda progress: None,
        on_stats: Callable[[EngineStats], None] = lambda stats: None,
    ) -> None:
        """room: sequences the engine's running batches hold (max_num_seqs x dp); max_queue: sequences
        that may wait beyond them. On the engine thread, on_progress sees every snapshot and on_stats
        the engine's stats, at most every STATS_EVERY_S."""
        self.engine = engine
        self.room = room
        self.capacity = room + max_queue  # sequences outstanding at most
        self.keepalive_s = keepalive_s
        self.stall_timeout_s = stall_timeout_s
        self.on_progress = on_progress
        self.on_stats = on_stats
        self._stats_at = 0.0
        self._last_stats = EngineStats()
        self.failure: BaseException | None = None
        self._inbox: queue.Queue = queue.Queue()
        # Engine thread only: the requests in the engine, and those waiting for it by client.
        self._streams: dict[str, OutputStream] = {}
        self._in_engine: dict[str, int] = {}  # request id: its unfinished sequences
        self._queued: dict[str, deque[_Submit]] = {}  # by client, in order of arrival
        self._served_at: dict[str, int] = {}  # a waiting client's last turn; one never served goes first
        self._turns = itertools.count()
        self._outstanding = 0
        self._lock = threading.Lock()
        self._inside_since: float | None = None  # when the engine thread went into the engine
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, requests: list[Request], stream: OutputStream, client: str) -> None:
        """Queue an HTTP call's requests (all or none) as `client`'s; their progress goes to `stream`."""
        self.check_alive()
        sequences = sum(r.params.n for r in requests)
        with self._lock:
            if self._outstanding + sequences > self.capacity:
                raise QueueFull(
                    f"{self._outstanding} sequences outstanding, {sequences} more asked for "
                    f"(capacity {self.capacity})"
                )
            self._outstanding += sequences
        for r in requests:
            self._inbox.put(_Submit(r, stream, client))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def check_alive(self) -> None:
        """Raise EngineFailed when the engine failed, Stalled when it has been inside one step for longer
        than stall_timeout_s."""
        if self.failure is not None:
            raise EngineFailed(f"the engine failed: {self.failure}")
        since = self._inside_since  # one read: the engine thread may clear it meanwhile
        if since is None:
            return
        waited = time.monotonic() - since
        if waited > self.stall_timeout_s:
            raise Stalled(
                f"the engine has been inside one step for {waited:.0f} s (server.stall_timeout_s "
                f"{self.stall_timeout_s:g}): a rank is stopped or too slow; retry later"
            )

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
            self._inside_since = None
            # Nothing runs on a failed engine: its gauges must not keep their last values.
            self.on_stats(replace(self._last_stats, running=0, waiting=0, kv_blocks_used=0))
            waiting = {*self._streams.values(), *(s.stream for q in self._queued.values() for s in q)}
            for stream in waiting:
                stream.put(EngineFailed(f"the engine failed: {e}"))
            self._streams.clear()
            self._queued.clear()
            self._served_at.clear()

    def _source(self) -> Iterator[Request | None]:
        """The live request source drive() reads on this thread: None means 'nothing new now' (drive
        then steps the engine). The inbox is emptied first, then the queued requests go to the engine
        in turn across clients while it has room."""
        while True:
            self._inside_since = None
            idle = not self._queued and not self.engine.has_unfinished()
            try:
                item = self._inbox.get(block=idle, timeout=self.keepalive_s if idle else None)
            except queue.Empty:
                if idle:
                    self._inside_since = time.monotonic()
                    self.engine.keepalive()
                    self._report_stats()
                    continue
                item = None
            if item is _STOP:
                return
            if item is not None:
                self._take(item)
                continue
            while self._queued and sum(self._in_engine.values()) < self.room:
                submit = self._next_in_turn()
                self._streams[submit.request.request_id] = submit.stream
                self._in_engine[submit.request.request_id] = submit.request.params.n
                yield submit.request
            self._inside_since = time.monotonic()
            yield None

    def _take(self, item: _Submit | _Abort | _Ping) -> None:
        if isinstance(item, _Ping):
            item.reply()
        elif isinstance(item, _Submit):
            self._queued.setdefault(item.client, deque()).append(item)
        elif item.request_id in self._streams:
            self.engine.abort(item.request_id)
        else:
            # Not yet handed to the engine: drop it here. (A request's submission always comes through
            # the inbox before its abort; one in neither place has finished.)
            for client, waiting in self._queued.items():
                submit = next((s for s in waiting if s.request.request_id == item.request_id), None)
                if submit is not None:
                    waiting.remove(submit)
                    self._release(submit.request.params.n)
                    if not waiting:
                        self._forget(client)
                    return

    def _next_in_turn(self) -> _Submit:
        """The first waiting request of the client served least recently: a client that just arrived
        goes before one that just had its turn."""
        client = min(self._queued, key=lambda c: self._served_at.get(c, -1))
        waiting = self._queued[client]
        submit = waiting.popleft()
        self._served_at[client] = next(self._turns)
        if not waiting:
            self._forget(client)
        return submit

    def _forget(self, client: str) -> None:
        del self._queued[client]
        self._served_at.pop(client, None)

    def _report_stats(self, force: bool = False) -> None:
        # Rate-limited: through the Ray backend each read is a call to rank 0's actor.
        now = time.monotonic()
        if force or now - self._stats_at >= STATS_EVERY_S:
            self._stats_at = now
            self._last_stats = self.engine.stats
            self.on_stats(self._last_stats)

    def _refused(self, request: Request, error: ValueError) -> None:
        self._streams.pop(request.request_id).put(error)
        self._release(self._in_engine.pop(request.request_id))

    def _deliver(self, progress: Progress) -> None:
        self.on_progress(progress)
        stream = self._streams.get(progress.request_id)
        if progress.finished:
            self._streams.pop(progress.request_id, None)
            self._in_engine.pop(progress.request_id, None)
            self._release(len(progress.choices))
        elif progress.request_id in self._in_engine:
            # A finished sequence's slot takes the next request at once, not when its siblings end.
            self._in_engine[progress.request_id] = sum(c.finish_reason is None for c in progress.choices)
        if stream is not None:
            stream.put(progress)

    def _release(self, sequences: int) -> None:
        with self._lock:
            self._outstanding -= sequences


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(True)
