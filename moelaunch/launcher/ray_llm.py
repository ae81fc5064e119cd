"""The `ray` backend: the deployment's ranks as Ray actors (moelaunch.cluster.ray.backend), behind the same
LLM-shaped client the job modes use (`.engine`, `.tokenizer`, `.spec`, `.shutdown()`).

Every rank, rank 0 included, runs in an actor on the cluster; this process (the driver) only steps
rank 0's engine and streams its outputs to the job's front end, so it may sit on a login node."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from moelaunch.engine.build import EngineSpec
from moelaunch.launcher.deploy.config import DeployConfig
from moelaunch.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from moelaunch.cluster.ray.backend import RayGroup

ENTRY = "moelaunch.engine.build:build_engine_from_json"


class EngineProxy:
    """Rank 0's LLMEngine, called through its actor (the methods and attributes the job modes use)."""

    def __init__(self, group: RayGroup) -> None:
        self._group = group
        # Fixed for the engine's life: read once.
        self.config = group.call("config")
        self.max_model_len = group.call("max_model_len")
        self.kv_endpoints = group.call("kv_endpoints")  # disaggregated parts only; else None

    def check_request(self, *args: Any) -> None:
        self._group.call("check_request", *args)

    def connect_kv(self, endpoints: list) -> None:
        self._group.call("connect_kv", endpoints)

    def release_kv(self, request_id: str) -> None:
        self._group.call("release_kv", request_id)

    def add_request(self, *args: Any) -> None:
        self._group.call("add_request", *args)

    def step(self) -> list:
        return self._group.call("step")

    def has_unfinished(self) -> bool:
        return self._group.call("has_unfinished")

    def release(self, request_id: str) -> None:
        self._group.call("release", request_id)

    def abort(self, request_id: str) -> None:
        self._group.call("abort", request_id)

    def keepalive(self) -> None:
        self._group.call("keepalive")

    @property
    def stats(self):
        return self._group.call("stats")

    @property
    def expert_load(self):
        return self._group.call("expert_load")


class RayLLM:
    def __init__(self, cfg: DeployConfig, spec: EngineSpec) -> None:
        # Ray is optional: imported here, so the local backend runs where it is not installed.
        from moelaunch.cluster.ray.backend import GroupSpec, RayGroup
        from moelaunch.cluster.ray.session import RaySession

        c = cfg.cluster
        if c.address == "auto" and c.nodes > 1:
            raise cfg.error(
                "cluster.address",
                c.address,
                f"HOST:PORT of a running Ray head for nodes: {c.nodes} "
                "(auto starts a one-node cluster on this machine)",
            )
        self.spec = spec
        self.tokenizer = Tokenizer.from_dir(spec.weights.model)  # local: text never travels to the ranks
        group_spec = GroupSpec(
            c.nodes, c.devices_per_node, c.device, dict(c.env), c.timeouts.startup_s, c.timeouts.collective_s
        )
        self._session = RaySession.open(c.address, c.devices_per_node, c.timeouts.startup_s)
        try:
            self._group = RayGroup.start(group_spec, ENTRY, spec.to_json(), "worker_loop")
            for r in self._group.ranks:
                print(f"ray: {r.label()}, local rank {r.local_rank}", file=sys.stderr, flush=True)
            self.engine = EngineProxy(self._group)
        except BaseException:
            self._session.close()
            raise

    @property
    def capacity(self) -> int:
        """Sequences the deployment runs at once: max_num_seqs per DP replica."""
        return self.spec.engine.max_num_seqs * self.spec.parallel.dp

    def shutdown(self, graceful: bool = True) -> None:
        """Stop rank 0's engine (which releases the other ranks; skipped when not graceful, as after
        Ctrl-C), kill every actor, free the devices, and disconnect (stopping Ray if this process
        started it)."""
        try:
            self._group.close(stop="shutdown" if graceful else None)
        finally:
            self._session.close()
