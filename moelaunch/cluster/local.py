"""Worker processes on this machine, handed the torchrun env contract (the `local` backend)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from moelaunch.cluster.errors import ClusterError, is_peer_failure
from moelaunch.cluster.rendezvous import RankEnv

PR_SET_PDEATHSIG = 1
# The exit code of a worker that stopped because a collective failed: a peer is at fault, not it.
PEER_FAILED_EXIT = 3
# After a collective fails on rank 0, how long to wait for the worker at fault to show its exit.
BLAME_WINDOW_S = 3.0


def _worker_signals() -> None:
    """Linux: SIGTERM this process when its parent dies, so a killed rank 0 leaves no worker behind
    waiting out its collective timeout. Ctrl-C (SIGINT to the whole terminal group) is rank 0's to
    handle: the workers ignore it (an ignored signal stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn_workers(
    world_size: int, module: str, args: list[str], port: int, extra_env: Mapping[str, str] | None = None
) -> list[subprocess.Popen]:
    """Start ranks 1..world_size-1 as `python -m module *args`; rank 0 is the calling process."""
    procs = []
    for rank in range(1, world_size):
        contract = RankEnv(rank, rank, world_size, world_size, "127.0.0.1", port).as_env()
        env = {**os.environ, **(extra_env or {}), **contract}
        start = _worker_signals if sys.platform == "linux" else None
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env, preexec_fn=start))
    return procs


def stop_workers(procs: list[subprocess.Popen], timeout_s: float = 30.0, terminate: bool = False) -> None:
    """Wait for workers to exit (after SIGTERM when terminate); kill (by pid) any that do not."""
    for p in procs:
        if terminate and p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextmanager
def blaming_workers(procs: list[subprocess.Popen], timeout_s: float) -> Iterator[None]:
    """Rank 0's side of a local job: a collective that fails inside becomes one ClusterError naming the
    worker rank at fault and the cause."""
    try:
        yield
    except RuntimeError as e:
        if not procs or isinstance(e, ClusterError) or not is_peer_failure(e):
            raise
        raise _blame(procs, e, timeout_s) from None


def _blame(procs: list[subprocess.Popen], error: RuntimeError, timeout_s: float) -> ClusterError:
    """A worker that died on its own (any exit but PEER_FAILED_EXIT); else, on a timeout, the workers still
    running (they never reached the collective); else rank 0 was the late one (all peers gave up)."""
    deadline = time.monotonic() + BLAME_WINDOW_S
    while True:
        culprits = [(r, p) for r, p in enumerate(procs, start=1) if p.poll() not in (None, PEER_FAILED_EXIT)]
        if culprits or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    rerun = "The job was stopped; run it again to resume (a batch keeps every finished result)"
    if culprits:
        rank, proc = culprits[0]
        return ClusterError(f"rank {rank} (pid {proc.pid}) stopped: {_exit_cause(proc.returncode)}. {rerun}")
    limit = f"the collective timeout ({timeout_s:g} s: cluster.timeouts.collective_s, or --timeout)"
    running = [f"rank {r} (pid {p.pid})" for r, p in enumerate(procs, start=1) if p.poll() is None]
    if running and "Timed out" in str(error):
        return ClusterError(
            f"{', '.join(running)} did not reach a collective within {limit} while rank 0 waited: slower "
            f"than the timeout, or stuck. {rerun}; raise the timeout if a rank is busy that long"
        )
    if not running:
        return ClusterError(
            f"rank 0 was slower than {limit}: every other rank stopped waiting for it. {rerun}"
        )
    return ClusterError(f"a collective failed ({str(error).splitlines()[0]}). {rerun}")


def _exit_cause(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode} (its output is above)"


class WorkerWatch:
    """Rank 0's object (its engine) seen through `blaming_workers`: every method call that fails in a
    collective raises one ClusterError naming the worker at fault instead of gloo's connection error."""

    def __init__(self, target: Any, procs: list[subprocess.Popen], timeout_s: float) -> None:
        self._target, self._procs, self._timeout_s = target, procs, timeout_s

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr
        return self._watched(attr)

    def _watched(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with blaming_workers(self._procs, self._timeout_s):
                return method(*args, **kwargs)

        return call
