"""The server's address is checked before the model loads: a port in use, a host this machine does not
have, or a name it cannot resolve is one line naming the setting and the fix."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


@pytest.fixture
def taken_port():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


@pytest.mark.parametrize(
    "host, says",
    [
        ("127.0.0.1", "is in use (another server?)"),
        ("10.254.254.254", "server.host '10.254.254.254' is not an address of this machine"),
        ("no-such-host.invalid", "not an address or a name this machine can resolve"),
    ],
)
def test_an_address_the_server_cannot_take_is_refused_before_the_model_loads(taken_port, host, says):
    args = ["--set", f"server.host={host}", "--set", f"server.port={taken_port}"]
    done = subprocess.run(
        [sys.executable, "-m", "moelaunch.launcher.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and says in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "serve: http" not in done.stderr
