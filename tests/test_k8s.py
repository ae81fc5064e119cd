"""`launch k8s`: the KubeRay objects it writes, checked against the Kubernetes API's own types (the
kubernetes client's models) and KubeRay's CRD schemas (tests/data/kuberay, trimmed from KubeRay v1.7.0),
and sized from the plan."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kubernetes.client import ApiClient
from ray_nodes import isolated_network, node_env, start_raylet
from test_ray_backend import MAX_TOKENS, PROMPTS, results, write_prompts
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.cluster.rendezvous import free_port
from moelaunch.launcher import LLM, SamplingParams
from moelaunch.launcher.cli import main
from moelaunch.launcher.deploy.config import DeployConfig, load_deploy_config
from moelaunch.launcher.deploy.k8s import RUNTIME_HOST_BYTES
from moelaunch.launcher.deploy.plan import build_plan

REPO = Path(__file__).resolve().parents[1]
V3_EXAMPLE = REPO / "configs/examples/deepseek-v3-2x8-h200.yaml"
KUBERAY = REPO / "tests/data/kuberay"
GIB = 2**30
CUDA_ARGS = ["--image", "reg.example/moelaunch:1", "--model-path", "/models/v3", "--volume", "models:/models"]


def generate(tmp_path: Path, config: Path, *args: str) -> list[dict[str, Any]]:
    out = tmp_path / "k8s.yaml"
    assert main(["k8s", str(config), *args, "-o", str(out)]) == 0
    return list(yaml.safe_load_all(out.read_text()))


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {obj["kind"]: obj for obj in objects}


def unknown_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Keys the API server would prune: not declared where the schema declares its properties."""
    if isinstance(obj, list):
        return [
            f for i, x in enumerate(obj) for f in unknown_fields(x, schema.get("items", {}), f"{path}[{i}]")
        ]
    if not isinstance(obj, dict) or "properties" not in schema:
        return []
    found = []
    for key, value in obj.items():
        if key not in schema["properties"]:
            found.append(f"{path}.{key}")
        else:
            found += unknown_fields(value, schema["properties"][key], f"{path}.{key}")
    return found


def check_kuberay(obj: dict[str, Any], kind: str) -> None:
    schema = json.loads((KUBERAY / f"{kind}.v1.json").read_text())
    assert unknown_fields(obj, schema) == []
    jsonschema.validate(obj, schema)  # types, enums, required fields


def round_trip(data: dict[str, Any], model: str) -> dict[str, Any]:
    """Through the kubernetes client's model: a misspelt or misplaced field does not survive it."""
    client = ApiClient()
    return client.sanitize_for_serialization(client._ApiClient__deserialize(data, model))


def pod_templates(cluster_spec: dict[str, Any]) -> list[dict[str, Any]]:
    groups = [cluster_spec["headGroupSpec"], *cluster_spec["workerGroupSpecs"]]
    return [g["template"] for g in groups]


def check_core_objects(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        model = {"ConfigMap": "V1ConfigMap", "Service": "V1Service"}.get(obj["kind"])
        if model:
            assert round_trip(obj, model) == obj


def test_batch_on_two_gpu_nodes_is_one_rayjob_sized_from_the_plan(tmp_path):
    objects = generate(
        tmp_path,
        V3_EXAMPLE,
        *CUDA_ARGS,
        "--volume",
        "data:/data",
        "--set",
        "job.input=/data/prompts.jsonl",
        "--set",
        "job.output=/data/out/results.jsonl",
    )
    assert [o["kind"] for o in objects] == ["ConfigMap", "RayJob"]
    check_core_objects(objects)
    job = by_kind(objects)["RayJob"]
    check_kuberay(job, "rayjob")
    spec = job["spec"]
    # KubeRay checks this one in its controller, not in the CRD: its documented modes
    assert spec["submissionMode"] in {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["entrypoint"] == "launch /etc/moelaunch/deployment.yaml --set cluster.address=$RAY_ADDRESS"
    cluster = spec["rayClusterSpec"]
    for template in pod_templates(cluster):
        assert round_trip(template, "V1PodTemplateSpec") == template
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 2  # cluster.nodes
    (container,) = workers["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "8"  # devices_per_node
    assert limits["memory"] == f"{8 * RUNTIME_HOST_BYTES // GIB}Gi"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/models", "/data", "/etc/moelaunch", "/dev/shm"} <= mounts
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert cluster["headGroupSpec"]["rayStartParams"] == {"num-cpus": "0"}  # no rank on the head


def test_the_configmap_holds_the_deployment_the_pods_run(tmp_path):
    objects = generate(tmp_path, V3_EXAMPLE, *CUDA_ARGS, "--set", "job={mode: serve}")
    text = by_kind(objects)["ConfigMap"]["data"]["deployment.yaml"]
    in_pod = DeployConfig.model_validate(yaml.safe_load(text))
    here = load_deploy_config(V3_EXAMPLE, ["job={mode: serve}"])
    assert in_pod.model == "/models/v3"
    assert (in_pod.cluster.backend, in_pod.server.host) == ("ray", "0.0.0.0")
    assert in_pod.parallel == here.parallel and in_pod.engine == here.engine and in_pod.dtype == here.dtype


def test_serve_is_a_raycluster_a_rayjob_on_it_and_a_service_to_the_head(tmp_path):
    objects = generate(
        tmp_path, V3_EXAMPLE, *CUDA_ARGS, "--set", "job={mode: serve}", "--set", "server.port=8080",
        "--api-key-secret", "moe-key", "--namespace", "llm",
    )  # fmt: skip
    assert [o["kind"] for o in objects] == ["ConfigMap", "RayCluster", "RayJob", "Service"]
    assert {o["metadata"]["namespace"] for o in objects} == {"llm"}
    check_core_objects(objects)
    kinds = by_kind(objects)
    cluster, job, service = kinds["RayCluster"], kinds["RayJob"], kinds["Service"]
    check_kuberay(cluster, "raycluster")
    check_kuberay(job, "rayjob")
    for template in pod_templates(cluster["spec"]):
        assert round_trip(template, "V1PodTemplateSpec") == template
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert service["spec"]["selector"]["ray.io/node-type"] == "head"
    assert service["spec"]["ports"][0]["targetPort"] == 8080
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert head["env"] == [
        {"name": "MOELAUNCH_API_KEY", "valueFrom": {"secretKeyRef": {"name": "moe-key", "key": "api-key"}}}
    ]


def test_cpu_nodes_ask_for_their_ranks_memory_from_the_plan(tmp_path):
    config = tmp_path / "cpu.yaml"
    config.write_text(
        f"model: {REPO / 'configs/models/tiny-v3.json'}\nparallel: {{tp: 2, dp: 2}}\n"
        "cluster: {backend: ray, nodes: 2, devices_per_node: 2, device: cpu}\njob: {mode: bench}\n"
    )
    objects = generate(tmp_path, config, "--image", "img:1", "--cpus-per-rank", "3")
    cluster = by_kind(objects)["RayJob"]["spec"]["rayClusterSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["rayStartParams"] == {"num-cpus": "2"}  # one Ray CPU slot per rank
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    plan = build_plan(load_deploy_config(config))
    node0 = sum(r.total_bytes + RUNTIME_HOST_BYTES for r in plan.ranks if r.node == 0)
    assert limits == {"cpu": "6", "memory": f"{-(-node0 // GIB)}Gi"}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--set", "job={mode: chat}"], "chat needs a terminal"),
        (["--set", "cluster.device=auto"], "the devices of the Kubernetes nodes"),
        (["--set", "job={mode: serve}", "--set", "server.port=0"], "a fixed port"),
        (["--set", "job.input=/elsewhere/p.jsonl"], "a path under a --volume mount"),
    ],
)
def test_what_cannot_run_in_pods_is_refused_naming_the_fix(tmp_path, capsys, extra, message):
    assert main(["k8s", str(V3_EXAMPLE), *CUDA_ARGS, *extra]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--volume", "models"], ["--volume", "m:relative"], ["--name", "Bad_Name"]])
def test_bad_flags_are_usage_errors(bad):
    with pytest.raises(SystemExit) as e:
        main(["k8s", str(V3_EXAMPLE), *CUDA_ARGS, *bad])
    assert e.value.code == 2


@pytest.mark.slow
@pytest.mark.skipif(not isolated_network(), reason="Ray tests run inside a network namespace with only lo")
def test_the_rayjob_runs_its_configmap_on_a_cluster_shaped_like_its_pods(tmp_path):
    """What KubeRay does with the objects, on real raylets: a head that takes no ranks (num-cpus 0), one
    worker node, the ConfigMap's file at its mount path, the entrypoint in a shell with RAY_ADDRESS."""
    checkpoint = str(add_byte_tokenizer(make_hf_model(tmp_path / "ckpt", "v3", n_routed_experts=4)))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(checkpoint, max_model_len=128) as llm:
        reference = {
            k: o.outputs[0].token_ids
            for k, o in zip(PROMPTS, llm.generate(list(PROMPTS.values()), greedy), strict=True)
        }
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({
        "model": checkpoint,
        "parallel": {"tp": 2},
        "engine": {"max_model_len": 128, "max_num_seqs": 4},
        "cluster": {"backend": "ray", "nodes": 1, "devices_per_node": 2, "device": "cpu",
                    "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
                    "timeouts": {"startup_s": 90, "collective_s": 60}},
        "job": {"mode": "batch", "input": str(write_prompts(tmp_path / "prompts.jsonl", PROMPTS)),
                "output": str(tmp_path / "out.jsonl"), "max_tokens": MAX_TOKENS, "temperature": 0},
    }))  # fmt: skip
    objects = by_kind(generate(tmp_path, config, "--image", "img:1", "--volume", f"data:{tmp_path}"))
    mounted = tmp_path / "etc"
    mounted.mkdir()
    (mounted / "deployment.yaml").write_text(objects["ConfigMap"]["data"]["deployment.yaml"])
    spec = objects["RayJob"]["spec"]
    head_cpus = spec["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"]
    worker_cpus = spec["rayClusterSpec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"]
    port = free_port()
    nodes = [start_raylet("127.0.0.1", port=port, cpus=int(head_cpus))]
    try:
        nodes.append(start_raylet("127.0.0.2", head=f"127.0.0.1:{port}", cpus=int(worker_cpus)))
        entrypoint = spec["entrypoint"].replace("/etc/moelaunch", str(mounted))
        env = node_env(RAY_ADDRESS=f"127.0.0.1:{port}")
        done = subprocess.run(
            ["bash", "-c", entrypoint], env=env, capture_output=True, text=True, timeout=240
        )
    finally:
        for node in reversed(nodes):
            node.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    assert results(tmp_path / "out.jsonl") == reference
    assert (
        "on node 127.0.0.2" in done.stderr and "on node 127.0.0.1" not in done.stderr
    )  # ranks on the worker
