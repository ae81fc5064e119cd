"""Attach this process to Ray: a running cluster (`host:port`) or one started here (`auto`)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass

import ray

from moelaunch.cluster.errors import ClusterError

# The launcher moves step commands and token ids through Ray, never tensors: a small object store
# keeps an embedded cluster from reserving a third of the machine's shared memory.
OBJECT_STORE_BYTES = 200 * 10**6


@dataclass
class RaySession:
    address: str
    owns_connection: bool  # we called ray.init (so we disconnect, and stop Ray if we started it)
    temp_dir: str | None  # the embedded cluster's own session/log folder

    @classmethod
    def open(cls, address: str, cpus: int, timeout_s: float) -> RaySession:
        """`auto`: start a one-node Ray here with at least `cpus` CPU slots; `host:port`: join that head.

        Token authentication follows Ray's environment: with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN set,
        an embedded cluster requires the token, and joining a cluster sends it."""
        if ray.is_initialized():  # the caller (a notebook, a test) already chose a cluster
            return cls(address, False, None)
        quiet = {"logging_level": logging.WARNING, "configure_logging": True}
        if address == "auto":
            # Short prefix: Ray puts Unix sockets under this folder and their paths are limited to 107 bytes.
            temp_dir = tempfile.mkdtemp(prefix="mlray-")
            ray.init(
                address="local",
                num_cpus=max(os.cpu_count() or 1, cpus),
                object_store_memory=OBJECT_STORE_BYTES,
                include_dashboard=False,
                _temp_dir=temp_dir,
                **quiet,
            )
            return cls(address, True, temp_dir)
        _check_reachable(address, min(timeout_s, 10.0))
        ray.init(address=address, **quiet)
        return cls(address, True, None)

    def close(self) -> None:
        """Disconnect; this stops the cluster only if `open` started it (a joined cluster keeps running)."""
        if self.owns_connection:
            ray.shutdown()
            self.owns_connection = False
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def _check_reachable(address: str, timeout_s: float) -> None:
    # ray.init retries an unreachable head for minutes; one TCP connect says the same in seconds.
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ClusterError(f"cluster.address {address!r}: expected auto or HOST:PORT of a running Ray head")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ClusterError(
            f"no Ray head answers at {address} ({e.strerror or e}): start one there with "
            f"`ray start --head --node-ip-address {host} --port {port}`, or fix cluster.address "
            "(auto starts a one-node cluster on this machine)"
        ) from None
