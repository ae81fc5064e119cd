"""Checks on the nodes a deployment landed on, run before any process group forms: each failure is a
message naming the node and the fix, where a process group would only hang or crash later."""

from __future__ import annotations

import platform
from collections import defaultdict
from dataclasses import dataclass
from importlib import metadata

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from moelaunch.cluster.errors import ClusterError

VERSIONED = ("python", "ray", "torch")


@dataclass(frozen=True)
class NodeFacts:
    node_id: str
    ip: str
    python: str
    ray: str
    torch: str

    def versions(self) -> str:
        return ", ".join(f"{name} {getattr(self, name)}" for name in VERSIONED)


def _local_facts(node_id: str) -> NodeFacts:
    """Runs on the node itself: what its Python environment holds (metadata, so torch is not imported)."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "missing"
    return NodeFacts(
        node_id, ray.util.get_node_ip_address(), platform.python_version(), ray.__version__, torch_version
    )


def probe_nodes(node_ids: list[str], timeout_s: float) -> list[NodeFacts]:
    """Ask every node directly (a zero-CPU task pinned to it, so it runs even when the deployment holds
    all the node's slots): the driver's own versions say nothing about the workers'."""
    probe = ray.remote(num_cpus=0)(_local_facts)
    refs = {
        node: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(node)
        for node in node_ids
    }
    facts = []
    for node, ref in refs.items():
        try:
            facts.append(ray.get(ref, timeout=timeout_s))
        except GetTimeoutError:
            raise ClusterError(
                f"node {node} did not answer a version probe within {timeout_s:.0f} s"
            ) from None
        except RayError as e:
            raise ClusterError(
                f"node {node} could not run the launcher's probe ({type(e).__name__}: {e}); every node needs "
                "moelaunch, ray and torch installed in the same Python environment as the driver"
            ) from None
    return facts


def silent_nodes(node_ids: list[str], timeout_s: float) -> list[str]:
    """The nodes that do not run a trivial task within timeout_s: cut off (link down) or gone. Asked when
    a call times out, since a node that cannot be reached kills nothing Ray would report for a while."""
    ping = ray.remote(num_cpus=0)(lambda: None)
    refs = {
        ping.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(): node
        for node in dict.fromkeys(node_ids)
    }
    answered, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    return [node for ref, node in refs.items() if ref not in answered]


def check_nodes(facts: list[NodeFacts]) -> None:
    """Distinct IPs (ranks reach each other by node IP: MASTER_ADDR, gloo/NCCL) and one set of versions."""
    by_ip: dict[str, list[str]] = defaultdict(list)
    for f in facts:
        by_ip[f.ip].append(f.node_id)
    shared = {ip: nodes for ip, nodes in by_ip.items() if len(nodes) > 1}
    if shared:
        ip, nodes = next(iter(shared.items()))
        raise ClusterError(
            f"{len(nodes)} Ray nodes of the deployment share IP {ip} ({', '.join(n[:12] for n in nodes)}): "
            "ranks on different nodes find each other by node IP, so each node needs its own; start each "
            "raylet with a distinct `ray start --node-ip-address`, or use fewer cluster.nodes"
        )
    for name in VERSIONED:
        seen = {getattr(f, name) for f in facts}
        if len(seen) > 1:
            listing = "; ".join(f"{f.ip}: {f.versions()}" for f in facts)
            raise ClusterError(
                f"the nodes run different {name} versions ({', '.join(sorted(seen))}): {listing}; "
                f"install the same {name} on every node"
            )
    if any(f.torch == "missing" for f in facts):
        missing = ", ".join(f.ip for f in facts if f.torch == "missing")
        raise ClusterError(f"torch is not installed on {missing}; install the driver's versions there")


def capacity(resource: str) -> list[tuple[str, float]]:
    """(IP, total amount of `resource`) for every live node."""
    return [(n["NodeManagerAddress"], n["Resources"].get(resource, 0)) for n in ray.nodes() if n.get("Alive")]


def capacity_report(nodes: int, slots: int, resource: str, have: list[tuple[str, float]]) -> str:
    """What a deployment needs against what the cluster has."""
    enough = sum(1 for _, amount in have if amount >= slots)
    listing = ", ".join(f"{ip} with {amount:g}" for ip, amount in have) or "no live nodes"
    return (
        f"needed {nodes} node(s) x {slots} {resource} slot(s), one node each; the cluster has {len(have)} "
        f"node(s) ({listing} {resource}), {enough} of them big enough (slots other jobs hold also count)"
    )
