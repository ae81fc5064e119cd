"""Real Ray nodes for tests: `ray start --block` raylets on the IPs a test chooses (optionally inside a
network namespace it made), each in its own process group, so a test stops exactly what it started
(never `ray stop`, which kills every Ray process on the machine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
# Ray's usage reporting off, token auth off (a token file in ~/.ray would turn it on for heads only).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def node_env(**extra: str) -> dict[str, str]:
    """The environment for raylets and drivers: workers import this checkout, one thread per rank."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **RAY_ENV, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def isolated_network() -> bool:
    """Ray rewrites 127.0.0.1 to the default route's address: run it only where loopback is all there is."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def netns_prefix(netns: str | None) -> list[str]:
    # nsenter switches only the network namespace (`ip netns exec` also remounts /sys).
    return ["nsenter", f"--net=/run/netns/{netns}"] if netns else []


@dataclass
class Raylet:
    ip: str
    proc: subprocess.Popen
    log: Path

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM the raylet's process group (ray start, GCS, raylet, agents, workers), then SIGKILL."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and self.group_alive():
                self.proc.poll()  # reap `ray start` itself: a zombie still counts as a group member
                time.sleep(0.1)
            if not self.group_alive():
                break
        self.proc.wait(timeout=grace_s)
        shutil.rmtree(self.log.parent, ignore_errors=True)  # the node's temp dir (sessions, logs)

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True


def start_raylet(
    ip: str,
    head: str | None = None,
    port: int = 0,
    cpus: int = 2,
    netns: str | None = None,
    timeout_s: float = 90,
) -> Raylet:
    """A head (head=None, listening on ip:port) or a node joining `head` ("host:port"); returns when up."""
    # Short temp path: Ray's Unix socket paths under it must stay under 107 bytes.
    temp = tempfile.mkdtemp(prefix="mlr")
    args = [RAY, "start", "--block", "--node-ip-address", ip, "--num-cpus", str(cpus), "--temp-dir", temp]
    args += ["--object-store-memory", str(200 * 10**6), "--disable-usage-stats"]
    if head is None:
        args += ["--head", "--port", str(port), "--include-dashboard", "false"]
    else:
        # A node whose head is gone exits in seconds instead of retrying for a minute.
        args += ["--address", head]
    env = node_env(**({"RAY_gcs_rpc_server_reconnect_timeout_s": "5"} if head else {}))
    log = Path(temp) / "start.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            netns_prefix(netns) + args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    raylet = Raylet(ip, proc, log)
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raylet.stop()
            raise RuntimeError(f"raylet on {ip} did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.3)
    return raylet


@contextmanager
def two_hosts(subnet: str = "10.201.0"):
    """Two network namespaces joined by a veth pair named eth1 on both sides, at SUBNET.1 and SUBNET.2;
    yields their names. Only traffic between these two namespaces is possible."""
    names = [f"mlr{os.getpid()}{side}" for side in "ab"]
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run(
            [
                "ip",
                "link",
                "add",
                "eth1",
                "netns",
                names[0],
                "type",
                "veth",
                "peer",
                "name",
                "eth1",
                "netns",
                names[1],
            ],
            check=True,
        )
        for i, name in enumerate(names, start=1):
            for cmd in (
                ["addr", "add", f"{subnet}.{i}/24", "dev", "eth1"],
                ["link", "set", "eth1", "up"],
                ["link", "set", "lo", "up"],
            ):
                subprocess.run(["ip", "-n", name, *cmd], check=True)
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], check=False, stderr=subprocess.DEVNULL)
