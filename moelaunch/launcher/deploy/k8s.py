"""A deployment as KubeRay objects: the Ray cluster its plan needs (one head pod that runs the launcher,
one worker pod per node with the node's devices), the deployment file in a ConfigMap, and the job that
runs `launch` on the cluster.

- batch and bench: one RayJob that creates the cluster, runs the job and deletes the cluster after it.
- serve: a RayCluster, a RayJob that runs the server on it (clusterSelector), and a Service in front of
  the head pod, where the server listens (the launcher process is Ray's driver, on the head).

Resources come from the plan: each worker pod asks for its node's devices, and for host memory the plan's
per-rank totals on CPU nodes (there the "device" memory is host memory) or RUNTIME_HOST_BYTES per rank
on GPU nodes (CUDA context, NCCL buffers, the loader's staging) plus the same runtime on CPU.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from typing import Any

import yaml

from moelaunch.launcher.deploy.config import API_KEY_ENV, DeployConfig
from moelaunch.launcher.deploy.plan import LaunchPlan

RAY_VERSION = "2.60.0"  # the version the project pins: head, workers and submitter must match it
GIB = 2**30
RUNTIME_HOST_BYTES = 6 * GIB  # one rank's process outside its plan: torch, CUDA context, NCCL, staging
HEAD_CPUS = 2  # the launcher: tokenizer, scheduler, the HTTP server; no ranks run on the head
HEAD_MEMORY_BYTES = 8 * GIB
CONFIG_DIR = "/etc/moelaunch"
CONFIG_FILE = "deployment.yaml"
SHM_BYTES = 8 * GIB  # /dev/shm for Ray's object store and torch's shared tensors (the default is 64 MB)
API_KEY_SECRET_KEY = "api-key"


@dataclass(frozen=True)
class Volume:
    """A PersistentVolumeClaim mounted at the same path in every pod (checkpoints, prompts, results)."""

    claim: str
    path: str

    @classmethod
    def parse(cls, text: str) -> Volume:
        claim, sep, path = text.partition(":")
        if not sep or not claim or not path.startswith("/"):
            raise ValueError(f"--volume {text!r}: expected CLAIM:/MOUNT/PATH, e.g. models:/models")
        return cls(claim, path)


@dataclass(frozen=True)
class K8sOptions:
    image: str
    namespace: str = "default"
    name: str = "moelaunch"
    model_path: str | None = None  # the checkpoint's path inside the pods; default: the file's `model`
    volumes: tuple[Volume, ...] = ()
    cpus_per_rank: int = 8
    api_key_secret: str | None = None  # a Secret whose `api-key` holds the server's key


def manifests(plan: LaunchPlan, options: K8sOptions) -> list[dict[str, Any]]:
    """The objects to `kubectl apply`, in order."""
    cfg = plan.config
    _check_deployable(cfg, options)
    config_map = _config_map(cfg, options)
    cluster = _ray_cluster_spec(plan, options)
    if cfg.job.mode != "serve":
        job = _ray_job(options, {"rayClusterSpec": cluster, "shutdownAfterJobFinishes": True})
        job["spec"]["ttlSecondsAfterFinished"] = 300  # time to read the head's logs before it goes
        return [config_map, job]
    ray_cluster = _object("ray.io/v1", "RayCluster", options.name, options, cluster)
    job = _ray_job(options, {"clusterSelector": {"ray.io/cluster": options.name}})
    return [config_map, ray_cluster, job, _service(cfg, options)]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the deployment file in the ConfigMap) as literal blocks a person can read."""


def _string(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_Dumper.add_representer(str, _string)


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def _check_deployable(cfg: DeployConfig, options: K8sOptions) -> None:
    if cfg.job.mode == "chat":
        raise cfg.error("job.mode", "chat", "batch, bench or serve on Kubernetes (chat needs a terminal)")
    if cfg.cluster.device == "auto":
        # The plan would look at this machine's devices, not the cluster's.
        raise cfg.error("cluster.device", "auto", "cuda or cpu: the devices of the Kubernetes nodes")
    if cfg.job.mode == "serve" and cfg.server.port == 0:
        raise cfg.error("server.port", 0, "a fixed port for the Service to forward to, e.g. 8000")
    if cfg.job.mode == "batch":
        # The job's files must outlive the pods: they belong on a mounted volume.
        mounts = [v.path.rstrip("/") + "/" for v in options.volumes]
        for key, path in (("job.input", cfg.job.input), ("job.output", cfg.job.output)):
            if not any(path.startswith(m) for m in mounts):
                raise cfg.error(
                    key,
                    path,
                    "a path under a --volume mount, e.g. --volume data:/data --set job.input=/data/x",
                )


def _config_map(cfg: DeployConfig, options: K8sOptions) -> dict[str, Any]:
    """The deployment as the pods run it: on the Ray cluster KubeRay starts, reachable from outside."""
    data = cfg.model_dump(mode="json", exclude_none=True)
    data["model"] = options.model_path or cfg.model
    data["cluster"]["backend"] = "ray"
    if cfg.job.mode == "serve":
        data["server"]["host"] = "0.0.0.0"  # the Service forwards to the pod's address, not its loopback
    text = yaml.safe_dump(data, sort_keys=False)
    return _object("v1", "ConfigMap", f"{options.name}-config", options, data={CONFIG_FILE: text})


def _ray_job(options: K8sOptions, cluster: dict[str, Any]) -> dict[str, Any]:
    # Ray sets RAY_ADDRESS (the GCS host:port) for a job's entrypoint, which runs in a shell on the head.
    entrypoint = f"launch {shlex.quote(f'{CONFIG_DIR}/{CONFIG_FILE}')} --set cluster.address=$RAY_ADDRESS"
    spec = {"entrypoint": entrypoint, "submissionMode": "K8sJobMode", **cluster}
    return _object("ray.io/v1", "RayJob", options.name, options, spec)


def _ray_cluster_spec(plan: LaunchPlan, options: K8sOptions) -> dict[str, Any]:
    c = plan.config.cluster
    head = {
        "rayStartParams": {"num-cpus": "0"},  # no rank lands on the head: it runs the launcher only
        "template": _pod(options, "ray-head", HEAD_CPUS, HEAD_MEMORY_BYTES, gpus=0, head=True),
    }
    ranks = c.devices_per_node
    gpus = ranks if plan.device == "cuda" else 0
    worker_start = {} if gpus else {"num-cpus": str(ranks)}  # one CPU slot per rank on CPU nodes
    worker = {
        "groupName": "ranks",
        "replicas": c.nodes,
        "minReplicas": c.nodes,
        "maxReplicas": c.nodes,
        "rayStartParams": worker_start,
        "template": _pod(
            options, "ray-worker", options.cpus_per_rank * ranks, _node_memory(plan), gpus, head=False
        ),
    }
    return {"rayVersion": RAY_VERSION, "headGroupSpec": head, "workerGroupSpecs": [worker]}


def _node_memory(plan: LaunchPlan) -> int:
    """Host memory of the busiest node: its ranks' plan totals on CPU, the runtime alone on GPU."""
    per_node: dict[int, int] = {}
    for r in plan.ranks:
        own = r.total_bytes if plan.device == "cpu" else 0
        per_node[r.node] = per_node.get(r.node, 0) + own + RUNTIME_HOST_BYTES
    return max(per_node.values())


def _pod(options: K8sOptions, container: str, cpus: int, memory: int, gpus: int, head: bool) -> dict:
    quantities = {"cpu": str(cpus), "memory": f"{math.ceil(memory / GIB)}Gi"}
    if gpus:
        quantities["nvidia.com/gpu"] = str(gpus)
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{options.name}-config"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{SHM_BYTES // GIB}Gi"}},
    ]
    for i, v in enumerate(options.volumes):
        mounts.append({"name": f"data-{i}", "mountPath": v.path})
        volumes.append({"name": f"data-{i}", "persistentVolumeClaim": {"claimName": v.claim}})
    spec: dict[str, Any] = {
        "name": container,
        "image": options.image,
        "resources": {"requests": dict(quantities), "limits": dict(quantities)},
        "volumeMounts": mounts,
    }
    if head and options.api_key_secret:
        secret = {"name": options.api_key_secret, "key": API_KEY_SECRET_KEY}
        spec["env"] = [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": secret}}]
    return {"spec": {"containers": [spec], "volumes": volumes}}


def _service(cfg: DeployConfig, options: K8sOptions) -> dict[str, Any]:
    port = cfg.server.port
    spec = {
        "selector": {"ray.io/cluster": options.name, "ray.io/node-type": "head"},
        "ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}],
    }
    return _object("v1", "Service", options.name, options, spec)


def _object(
    api_version: str,
    kind: str,
    name: str,
    options: K8sOptions,
    spec: dict[str, Any] | None = None,
    data: dict[str, str] | None = None,
) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "moelaunch", "app.kubernetes.io/instance": options.name}
    obj: dict[str, Any] = {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": options.namespace, "labels": labels},
    }
    if spec is not None:
        obj["spec"] = spec
    if data is not None:
        obj["data"] = data
    return obj
