"""One rank of a deployment as a Ray actor: it builds its rank's object from an entry point, then either
serves calls (rank 0) or runs the object's loop (the other ranks, which follow rank 0)."""

from __future__ import annotations

import importlib
import os
from typing import Any

import ray

from moelaunch.cluster.rendezvous import free_port


class RankActor:
    def __init__(self) -> None:
        self._obj: Any = None

    def where(self) -> tuple[str, int]:
        """This rank's node IP and process id (for the rank table and for naming a rank that died)."""
        return ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        # Asked of rank 0 only: MASTER_PORT must be free on rank 0's node, not on the driver's.
        return free_port("")

    def start(self, entry: str, payload: str, contract: dict[str, str]) -> None:
        """Set the torchrun env contract, then build the object with `module:function(payload)`."""
        os.environ.update(contract)
        module, _, function = entry.partition(":")
        self._obj = getattr(importlib.import_module(module), function)(payload)

    def run(self, method: str) -> None:
        getattr(self._obj, method)()

    def call(self, name: str, *args: Any) -> Any:
        """A method's result, or an attribute's value (the driver reads e.g. the engine's config)."""
        attr = getattr(self._obj, name)
        return attr(*args) if callable(attr) else attr
