"""`launch serve` in a child process for the serving benchmarks: started from a deployment file, waited
for until /health answers, its output kept in a log file beside the file."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 300


def start_server(config: Path, port: int) -> tuple[subprocess.Popen, str]:
    """The server process and its URL; its output goes to CONFIG.log."""
    log_path = config.with_suffix(".log")
    log = open(log_path, "w")  # noqa: SIM115 - the server's output, kept while it runs
    proc = subprocess.Popen(
        [sys.executable, "-m", "moelaunch.launcher.cli", "serve", str(config)], stdout=log, stderr=log
    )
    return proc, wait_until_healthy(proc, port, log_path)


def wait_until_healthy(proc: subprocess.Popen, port: int, log_path: Path) -> str:
    """The URL of a server on `port` once its /health answers 200; killed, with its log's tail, if it
    exits or takes more than START_TIMEOUT_S."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not come up:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
