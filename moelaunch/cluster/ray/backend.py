"""A deployment's ranks on a Ray cluster, torchrun-style: `nodes` x `slots_per_node` ranks, rank r on
node r // slots_per_node with local rank r % slots_per_node (so a node's ranks are contiguous and TP
groups, which are consecutive ranks, stay within a node).

One placement group holds one bundle per node (STRICT_SPREAD: a different node each); one actor per
rank gets the torchrun env contract. Rank 0 serves calls; every call also watches the other ranks, so a
dead rank ends the deployment within seconds with its rank and node named. Closing kills every actor
by handle and frees the placement group: no process is left behind.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from moelaunch.cluster.errors import ClusterError
from moelaunch.cluster.ray.actors import RankActor
from moelaunch.cluster.ray.checks import (
    NodeFacts,
    capacity,
    capacity_report,
    check_nodes,
    probe_nodes,
    silent_nodes,
)
from moelaunch.cluster.rendezvous import RankEnv

RESOURCES = {"cuda": "GPU", "cpu": "CPU"}
# After a rank fails, how long to wait for Ray to report a dead process that caused it.
BLAME_WINDOW_S = 5.0
PING_S = 5.0  # how long a node may take to run a trivial task before it counts as cut off


@dataclass(frozen=True)
class GroupSpec:
    nodes: int
    slots_per_node: int  # ranks per node: GPUs, or CPU slots on CPU-only nodes
    device: str = "auto"  # cuda | cpu | auto (cuda when the cluster has GPUs)
    env: dict[str, str] = field(default_factory=dict)  # for every rank's process
    startup_timeout_s: float = 600.0  # devices, checks, and building every rank's object
    call_timeout_s: float = 600.0  # one call to rank 0

    @property
    def world(self) -> int:
        return self.nodes * self.slots_per_node


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    ip: str
    pid: int

    def label(self) -> str:
        # pid 0: the actor has not reported its process yet
        return f"rank {self.rank} on node {self.ip}" + (f" (pid {self.pid})" if self.pid else "")


class RayGroup:
    """Start with `RayGroup.start`; `call` rank 0; `close` when done (idempotent; a failure closes)."""

    def __init__(
        self, spec: GroupSpec, pg: PlacementGroup, actors: list[Any], facts: list[NodeFacts]
    ) -> None:
        self.spec = spec
        self._pg = pg
        self._actors = actors
        self._node_ids = [facts[r // spec.slots_per_node].node_id for r in range(spec.world)]  # by rank
        ips = [facts[r // spec.slots_per_node].ip for r in range(spec.world)]
        self.ranks = [RankInfo(r, r % spec.slots_per_node, ips[r], 0) for r in range(spec.world)]
        self._loops: dict[Any, int] = {}  # ranks > 0: their run() ref -> rank
        self._closed = False

    @classmethod
    def start(cls, spec: GroupSpec, entry: str, payload: str, loop_method: str) -> RayGroup:
        """Reserve the devices, check the nodes, start one actor per rank and build each rank's object
        with `entry` ("module:function", called with `payload`); ranks > 0 then run `loop_method`."""
        deadline = time.monotonic() + spec.startup_timeout_s
        resource = _resource(spec.device)
        pg = _reserve(spec, resource, deadline)
        try:
            bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
            facts = probe_nodes([bundle_nodes[i] for i in range(spec.nodes)], _left(deadline))
            check_nodes(facts)
            actors = [_rank_actor(spec, pg, resource, r // spec.slots_per_node) for r in range(spec.world)]
        except BaseException:
            remove_placement_group(pg)
            raise
        group = cls(spec, pg, actors, facts)
        try:
            group._boot(entry, payload, loop_method, deadline)
        except BaseException:
            group.close()
            raise
        return group

    def _boot(self, entry: str, payload: str, loop_method: str, deadline: float) -> None:
        where = self._wait_all({a.where.remote(): r for r, a in enumerate(self._actors)}, "start", deadline)
        self.ranks = [RankInfo(r.rank, r.local_rank, *where[r.rank]) for r in self.ranks]
        [port] = self._wait_all({self._actors[0].free_port.remote(): 0}, "find a free port", deadline)
        s = self.spec
        contracts = [
            RankEnv(r.rank, r.local_rank, s.world, s.slots_per_node, self.ranks[0].ip, port)
            for r in self.ranks
        ]
        starts = {
            a.start.remote(entry, payload, c.as_env()): r
            for r, (a, c) in enumerate(zip(self._actors, contracts, strict=True))
        }
        self._wait_all(starts, "build its part of the deployment", deadline)
        self._loops = {a.run.remote(loop_method): r for r, a in enumerate(self._actors) if r > 0}

    def _wait_all(self, refs: dict[Any, int], what: str, deadline: float) -> list[Any]:
        """Results in rank order; the first rank to fail ends the wait (its peers would only hang)."""
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=_left(deadline))
            if not ready:
                late = ", ".join(str(refs[p]) for p in pending)
                self._fail(
                    f"rank(s) {late} did not {what} within cluster.timeouts.startup_s = "
                    f"{self.spec.startup_timeout_s:g} s"
                )
            rank = refs[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayError as e:
                self._fail(f"{self.ranks[rank].label()} could not {what}: {_reason(e)}")
        return [results[r] for r in sorted(results)]

    def call(self, name: str, *args: Any) -> Any:
        """Rank 0's `name(*args)` (or attribute `name`). A ValueError it raises (a rejected request) is
        re-raised as itself; any other failure, or a rank dying meanwhile, ends the deployment with a
        ClusterError naming the rank at fault."""
        ref = self._actors[0].call.remote(name, *args)
        watched = {ref: 0, **self._loops}
        ready, _ = ray.wait(list(watched), num_returns=1, timeout=self.spec.call_timeout_s)
        if not ready:
            self._fail(
                self._cut_off_report()
                or f"rank 0 did not finish {name} within {self.spec.call_timeout_s:g} s"
            )
        if ready[0] == ref:
            try:
                return ray.get(ref)
            except RayTaskError as e:
                if isinstance(e.cause, ValueError):
                    raise e.cause from None
            except RayActorError:
                pass  # rank 0 itself died (its node went down): blamed below like any other rank
        self._fail_blaming(watched)

    def _fail_blaming(self, watched: dict[Any, int]) -> None:
        """Fail naming the rank whose process died, if Ray reports one within BLAME_WINDOW_S: when a rank
        dies, its peers' collectives fail too (connection reset), often before Ray reports the death."""
        deadline = time.monotonic() + BLAME_WINDOW_S
        pending, blamed = list(watched), None
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=_left(deadline))
            if not ready:
                break
            died, reason = _outcome(ready[0])
            if died or blamed is None:
                blamed = (watched[ready[0]], reason)
            if died:
                break
        rank, reason = blamed
        self._fail(
            f"{self.ranks[rank].label()} stopped: {reason}. The deployment was shut down; rerun once the "
            "node is healthy"
        )

    def _cut_off_report(self) -> str | None:
        """After a timeout: the ranks on nodes that no longer run anything (a cut link, a frozen node),
        which the peers can only wait for."""
        silent = set(silent_nodes(self._node_ids, PING_S))
        cut_off = [
            info.label() for info, node in zip(self.ranks, self._node_ids, strict=True) if node in silent
        ]
        if not cut_off:
            return None
        return (
            f"{', '.join(cut_off)} stopped answering: the node did not run a trivial task within "
            f"{PING_S:g} s after rank 0 waited {self.spec.call_timeout_s:g} s (its network link or the node "
            "is down). The deployment was shut down; rerun once the node is reachable"
        )

    def close(self, stop: str | None = None, grace_s: float = 10.0) -> None:
        """Call rank 0's `stop` method (which releases the other ranks from their loop) and give every
        rank `grace_s` to finish; then kill every actor by handle and free the placement group."""
        if self._closed:
            return
        self._closed = True
        if stop is not None:
            # Errors here change nothing: the kills below end every rank either way.
            ray.wait(
                [self._actors[0].call.remote(stop), *self._loops],
                num_returns=len(self._actors),
                timeout=grace_s,
            )
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self._pg)

    def _fail(self, message: str) -> None:
        self.close()
        raise ClusterError(message)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _resource(device: str) -> str:
    if device == "auto":
        return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"
    return RESOURCES[device]


def _reserve(spec: GroupSpec, resource: str, deadline: float) -> PlacementGroup:
    """One bundle of `slots_per_node` devices per node, each on a different node; waits until the
    startup deadline, then says what the cluster lacks."""
    have = capacity(resource)
    if sum(1 for _, amount in have if amount >= spec.slots_per_node) < spec.nodes:
        print(
            f"ray: waiting up to {spec.startup_timeout_s:g} s for devices: "
            f"{capacity_report(spec.nodes, spec.slots_per_node, resource, have)}",
            file=sys.stderr,
            flush=True,
        )
    pg = placement_group([{resource: spec.slots_per_node}] * spec.nodes, strategy="STRICT_SPREAD")
    ready, _ = ray.wait([pg.ready()], timeout=_left(deadline))
    if not ready:
        remove_placement_group(pg)
        report = capacity_report(spec.nodes, spec.slots_per_node, resource, capacity(resource))
        raise ClusterError(
            f"the Ray cluster did not provide the deployment's devices within cluster.timeouts.startup_s = "
            f"{spec.startup_timeout_s:g} s: {report}; add nodes (`ray start --address HEAD:PORT`) or change "
            "cluster.nodes / cluster.devices_per_node"
        )
    return pg


def _rank_actor(spec: GroupSpec, pg: PlacementGroup, resource: str, node: int) -> Any:
    env = dict(spec.env)
    if resource == "GPU":
        # Ray would show each actor only its own GPU as cuda:0; the contract's LOCAL_RANK picks the device.
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    amount = {"num_gpus": 1, "num_cpus": 0} if resource == "GPU" else {"num_cpus": 1}
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=node)
    options: dict[str, Any] = {"scheduling_strategy": strategy, **amount}
    if env:
        options["runtime_env"] = {"env_vars": env}
    return ray.remote(RankActor).options(**options).remote()


def _outcome(ref: Any) -> tuple[bool, str]:
    """(whether the rank's process died, what happened) for a finished call or loop."""
    try:
        ray.get(ref, timeout=0)
    except RayError as e:
        return isinstance(e, RayActorError), _reason(e)
    return False, "it left its loop before rank 0 told it to"


def _reason(error: RayError) -> str:
    if isinstance(error, RayTaskError):
        return f"{type(error.cause).__name__}: {error.cause}"
    if isinstance(error, RayActorError):
        return "its process died (killed, out of memory, or its node went down)"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
