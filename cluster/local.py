"""Worker processes on this machine, handed the torchrun env contract (the `local` backend)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
from collections.abc import Mapping

from moelaunch.cluster.rendezvous import RankEnv

PR_SET_PDEATHSIG = 1


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
