"""`launch serve` as a subprocess for the server tests: started from a deployment file, waited on
until /health answers, stopped with SIGINT (as Ctrl-C stops it) with every worker rank gone."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

START_TIMEOUT_S = 120


@contextmanager
def served(config: Path, port: int) -> Iterator[dict]:
    """Yields {"url", "proc", "log", "workers"}; `port` is the config's server.port; the server's
    output goes to config's .log file."""
    log = config.with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moelaunch.launcher.cli", "serve", str(config)], stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, f"the server exited:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server did not come up:\n{log.read_text()}"
        time.sleep(0.5)
    workers = psutil.Process(proc.pid).children(recursive=True)
    yield {"url": url, "proc": proc, "log": log, "workers": workers}
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the server did not stop on SIGINT:\n{log.read_text()}") from None
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, "a worker rank outlived the server"
