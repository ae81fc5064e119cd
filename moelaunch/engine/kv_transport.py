"""Moving KV bytes between engines with Mooncake's transfer engine, as SGLang does.

Each rank of a disaggregated deployment opens one transfer engine, registers its latent cache with it,
and publishes its session ("host:port"). A decode rank then reads the blocks it needs straight out of
a prefill rank's cache: the prefill side takes no part in the copy. Here the TCP transport runs (no
RDMA card needed); Mooncake picks RDMA where the machine has it.
"""

from __future__ import annotations

import os
import socket

import torch

INSTALL_HINT = (
    "install Mooncake's transfer engine: `pip install mooncake-transfer-engine-non-cuda` "
    "(or `pip install 'moelaunch[disagg]'`) and Debian's libibverbs1 (`apt-get install libibverbs1`)"
)
# Reads per batch: a larger batch overflows the TCP transport's queues, and the whole batch fails.
MAX_BATCH = 1024
TIMEOUT_VARIABLES = ("MC_TRANSFER_TIMEOUT", "MC_TCP_STATUS_TIMEOUT_SEC", "MC_TCP_PROGRESS_TIMEOUT_SEC")
# A timeout the user set for Mooncake wins over the deployment's collective timeout.
_USER_TIMEOUTS = {name for name in TIMEOUT_VARIABLES if name in os.environ}


class KVTransferError(RuntimeError):
    """A read of a peer's KV blocks failed: the peer died, hung past the timeout, or is unreachable."""


def transport_available() -> str | None:
    """None when Mooncake's transfer engine imports, else why not and how to fix it."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        return f"prefill/decode disaggregation needs Mooncake's transfer engine ({e}): {INSTALL_HINT}"
    return None


def local_host(peer: str | None) -> str:
    """This machine's address as `peer` sees it (the interface that routes there), or loopback."""
    if not peer or peer in ("localhost", "127.0.0.1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # UDP: no packet is sent, the kernel only picks the route
        return s.getsockname()[0]


class MooncakeTransport:
    name = "mooncake-tcp"

    def __init__(self, host: str, timeout_s: float) -> None:
        # A read from a hung peer fails after this many seconds. Mooncake reads it once per process, when
        # its first engine starts (one rank per process: each rank's own timeout).
        # (a first read also waits on the TCP transport's status and progress timeouts: all three).
        for name in TIMEOUT_VARIABLES:
            if name not in _USER_TIMEOUTS:
                os.environ[name] = str(max(1, int(timeout_s)))
        # Its failures come back as return codes, reported here with their cause; its own log, errors
        # only (MC_LOG_LEVEL=INFO shows all; the one error at start, no local segment yet, is harmless).
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        problem = transport_available()
        if problem:
            raise RuntimeError(problem)
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        # P2PHANDSHAKE: peers exchange buffer metadata directly, so no metadata server runs.
        if self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake's transfer engine did not start on {host}: {INSTALL_HINT}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[torch.Tensor] = []  # kept alive while registered

    def register(self, tensor: torch.Tensor) -> int:
        """Make a contiguous tensor readable by peers; returns its address."""
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered for transfer")
        ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if self._engine.register_memory(ptr, size) != 0:
            raise RuntimeError(f"Mooncake could not register {size:,} bytes of KV cache")
        self._registered.append(tensor)
        return ptr

    def read(self, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        """Copy lengths[i] bytes at the peer's address remote[i] to this process's address local[i]."""
        for start in range(0, len(lengths), MAX_BATCH):
            end = start + MAX_BATCH
            if self._engine.batch_transfer_sync_read(
                peer, local[start:end], remote[start:end], lengths[start:end]
            ):
                timeout = os.environ["MC_TRANSFER_TIMEOUT"]
                raise KVTransferError(
                    f"reading {sum(lengths):,} KV bytes from {peer} failed: the prefill rank there died, "
                    f"hung past MC_TRANSFER_TIMEOUT={timeout} s, or cannot be reached"
                )
