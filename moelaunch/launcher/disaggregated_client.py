"""A disaggregated deployment's client: its prefill and decode instances, each opened on the backend
like a deployment of its own, behind one router (engine/disaggregated.py) with the LLM-shaped
interface the job modes use (`.engine`, `.tokenizer`, `.spec`, `.shutdown()`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moelaunch.engine.build import EngineSpec
from moelaunch.engine.disaggregated import DisaggregatedEngine
from moelaunch.launcher.deploy.config import DeployConfig


@dataclass(frozen=True)
class Part:
    role: str  # "prefill" or "decode"
    cfg: DeployConfig  # the part's own deployment (its layout, nodes and devices per node)
    spec: EngineSpec  # with kv_role set
    replicas: int


class DisaggregatedClient:
    def __init__(
        self, cfg: DeployConfig, parts: list[Part], open_part: Callable[[DeployConfig, EngineSpec], Any]
    ):
        self._session = None
        if cfg.cluster.backend == "ray":
            # One Ray session for every instance, with CPU slots for all of them (each instance's
            # placement group reserves its own).
            from moelaunch.cluster.ray.session import RaySession

            c = cfg.cluster
            slots = sum(p.replicas * p.cfg.cluster.devices_per_node * p.cfg.cluster.nodes for p in parts)
            self._session = RaySession.open(c.address, slots, c.timeouts.startup_s)
        self._clients: list[tuple[str, Any]] = []
        try:
            for part in parts:
                for replica in range(part.replicas):
                    print(f"disaggregation: starting {part.role} instance {replica}", file=sys.stderr)
                    self._clients.append((part.role, open_part(part.cfg, part.spec)))
            engines = {
                role: [c.engine for r, c in self._clients if r == role] for role in ("prefill", "decode")
            }
            self.engine = DisaggregatedEngine(engines["prefill"], engines["decode"])
        except BaseException:
            self.shutdown(graceful=False)
            raise
        transport = self.engine.transport
        print(f"disaggregation: KV moves over {transport}", file=sys.stderr, flush=True)
        self.tokenizer = self._clients[0][1].tokenizer
        self.spec = parts[-1].spec

    @property
    def capacity(self) -> int:
        """Sequences the decode instances run at once."""
        return sum(client.capacity for role, client in self._clients if role == "decode")

    def shutdown(self, graceful: bool = True) -> None:
        if hasattr(self, "engine"):
            self.engine.close()
        clients, self._clients = self._clients, []
        try:
            for _, client in reversed(clients):
                client.shutdown(graceful)
        finally:
            if self._session is not None:
                self._session.close()
                self._session = None
