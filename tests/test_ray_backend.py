"""The ray backend on real raylets: a tp2 x dp2 deployment on two nodes (two raylets on distinct
loopback IPs, then two network namespaces) gives the single process's greedy outputs; an embedded
cluster runs with token auth; a disaggregated deployment (prefill tp=2, decode dp=2) gives the same
tokens; too few nodes, a shared IP and a killed rank each end with a clear
error, and a rerun resumes the batch job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from ray_nodes import REPO, Raylet, isolated_network, netns_prefix, node_env, start_raylet, two_hosts
from tiny_models import add_byte_tokenizer, make_hf_model

pytest.importorskip("ray")

from moelaunch.cluster.errors import ClusterError  # noqa: E402
from moelaunch.cluster.ray.checks import NodeFacts, capacity_report, check_nodes  # noqa: E402
from moelaunch.cluster.ray.session import RaySession  # noqa: E402
from moelaunch.cluster.rendezvous import free_port  # noqa: E402
from moelaunch.engine.kv_transport import transport_available  # noqa: E402
from moelaunch.launcher import LLM, SamplingParams  # noqa: E402
from moelaunch.launcher.deploy.config import DeployConfigError, load_deploy_config  # noqa: E402
from moelaunch.launcher.ray_llm import RayLLM  # noqa: E402
from moelaunch.text.tokenizer import Tokenizer  # noqa: E402

needs_private_net = pytest.mark.skipif(
    not isolated_network(), reason="Ray tests run inside a network namespace with only lo (see .ci/run)"
)
PROMPTS = {
    "a": "hello world",
    "b": "the quick brown fox",
    "c": [{"role": "user", "content": "hi there"}],
    "d": "moelaunch",
    "e": "12+34=",
}
MAX_TOKENS = 8
RANK_LINE = re.compile(r"ray: rank (\d+) on node ([\d.]+) \(pid (\d+)\)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    # 12 experts: divisible by the EP sizes used here (4 for tp2 x dp2, 6 for tp2 x dp3).
    path = tmp_path_factory.mktemp("tiny")
    return str(add_byte_tokenizer(make_hf_model(path, "v3", num_hidden_layers=4, n_routed_experts=12)))


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[str, list[int]]:
    """Greedy token ids from one process, the outputs every layout must reproduce."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(checkpoint, max_model_len=128) as llm:
        outs = llm.generate(list(PROMPTS.values()), greedy)
    return {k: o.outputs[0].token_ids for k, o in zip(PROMPTS, outs, strict=True)}


def write_prompts(path: Path, prompts: dict[str, object], **fields: object) -> Path:
    rows = [
        {"id": k, ("prompt" if isinstance(p, str) else "messages"): p, **fields} for k, p in prompts.items()
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def deployment(tmp_path: Path, checkpoint: str, address: str, **changes: object) -> Path:
    """A batch deployment file: tp2 x dp2 over 2 nodes x 2 CPU slots unless `changes` say otherwise."""
    cfg = {
        "model": checkpoint,
        "parallel": {"tp": 2, "dp": 2},
        "engine": {"max_model_len": 128, "max_num_seqs": 4},
        "cluster": {
            "backend": "ray",
            "address": address,
            "nodes": 2,
            "devices_per_node": 2,
            "device": "cpu",
            "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
            "timeouts": {"startup_s": 90, "collective_s": 60},
        },
        "job": {
            "mode": "batch",
            "input": str(write_prompts(tmp_path / "prompts.jsonl", PROMPTS)),
            "output": str(tmp_path / "results.jsonl"),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        },
    }
    for key, value in changes.items():
        *parents, last = key.split("__")
        node = cfg
        for part in parents:
            node = node[part]
        node[last] = value
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(
    config: Path, *args: str, netns: str | None = None, timeout_s: float = 180, **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*netns_prefix(netns), sys.executable, "-m", "moelaunch.launcher.cli", str(config), *args],
        cwd=REPO,
        env=node_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def results(path: Path) -> dict[str, list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r["token_ids"] for r in rows}


def rank_table(stderr: str) -> dict[int, tuple[str, int]]:
    return {int(r): (ip, int(pid)) for r, ip, pid in RANK_LINE.findall(stderr)}


def assert_gone(pids: list[int], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "a rank's process outlived the job"


# --- checks without a cluster -------------------------------------------------------------------


def facts(ip: str, torch: str = "2.13.0", node: str = "") -> NodeFacts:
    return NodeFacts(node or f"node-{ip}-{torch}", ip, "3.11.7", "2.60.0", torch)


def test_node_checks_name_the_problem():
    check_nodes([facts("10.0.0.1"), facts("10.0.0.2")])
    with pytest.raises(ClusterError, match=r"share IP 10.0.0.1 .*--node-ip-address"):
        check_nodes([facts("10.0.0.1", node="n1"), facts("10.0.0.1", node="n2")])
    with pytest.raises(ClusterError, match=r"different torch versions \(2.12.0, 2.13.0\).*10.0.0.2: python"):
        check_nodes([facts("10.0.0.1"), facts("10.0.0.2", torch="2.12.0")])
    report = capacity_report(2, 2, "CPU", [("127.0.0.1", 2.0)])
    assert report.startswith("needed 2 node(s) x 2 CPU slot(s), one node each; the cluster has 1 node(s)")


def test_unreachable_head_fails_fast():
    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"no Ray head answers at 127.0.0.1:\d+.*ray start --head"):
        RaySession.open(f"127.0.0.1:{free_port()}", 2, timeout_s=5)
    assert time.monotonic() - start < 6


def test_embedded_cluster_is_one_node(tmp_path, checkpoint):
    cfg = load_deploy_config(deployment(tmp_path, checkpoint, "auto"))
    with pytest.raises(DeployConfigError, match=r"cluster.address: given 'auto'; allowed: HOST:PORT"):
        RayLLM(cfg, None)


# --- real clusters ------------------------------------------------------------------------------


@pytest.mark.slow
@needs_private_net
def test_embedded_cluster_with_token_auth(tmp_path, checkpoint, reference):
    # address auto: the launcher starts Ray itself, here with token authentication on.
    config = deployment(tmp_path, checkpoint, "auto", parallel__dp=1, cluster__nodes=1)
    done = launch(config, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0123456789abcdef0123456789abcdef")
    assert done.returncode == 0, done.stderr[-3000:]
    assert results(tmp_path / "results.jsonl") == reference
    assert_gone([pid for _, pid in rank_table(done.stderr).values()])


@pytest.fixture(scope="module")
def loopback_cluster():
    """Two raylets on one machine with distinct IPs (127.0.0.1 and 127.0.0.2, both on lo)."""
    if not isolated_network():
        pytest.skip("Ray tests run inside a network namespace with only lo (see .ci/run)")
    port = free_port()
    nodes = [start_raylet("127.0.0.1", port=port)]
    try:
        nodes.append(start_raylet("127.0.0.2", head=f"127.0.0.1:{port}"))
        yield f"127.0.0.1:{port}", nodes
    finally:
        for node in reversed(nodes):
            node.stop()
        assert not any(node.group_alive() for node in nodes), "a Ray process outlived its raylet"


@pytest.mark.slow
def test_two_raylets_tp2_dp2_match_one_process(tmp_path, checkpoint, reference, loopback_cluster):
    address, _ = loopback_cluster
    done = launch(deployment(tmp_path, checkpoint, address))
    assert done.returncode == 0, done.stderr[-3000:]
    assert results(tmp_path / "results.jsonl") == reference
    table = rank_table(done.stderr)
    # Ranks sorted by node: ranks 0-1 (one TP group) on one node, ranks 2-3 on the other.
    assert sorted(table) == [0, 1, 2, 3]
    assert table[0][0] == table[1][0] != table[2][0] == table[3][0]
    assert {table[0][0], table[2][0]} == {"127.0.0.1", "127.0.0.2"}
    assert_gone([pid for _, pid in table.values()])


@pytest.mark.slow
@pytest.mark.skipif(transport_available() is not None, reason=str(transport_available()))
def test_disaggregated_prefill_tp2_to_decode_dp2_matches_one_process(
    tmp_path, checkpoint, reference, loopback_cluster
):
    """A batch job through `launch` with a prefill part (tp=2) and a decode part (dp=2), one per raylet:
    the prompts' latent KV moves between them with Mooncake's transfer engine; the tokens are one
    process's. The chat prompts share their template's prefix, so later ones hit the decode side's cache."""
    address, _ = loopback_cluster
    config = deployment(tmp_path, checkpoint, address)
    cfg = yaml.safe_load(config.read_text())
    del cfg["parallel"], cfg["cluster"]["nodes"], cfg["cluster"]["devices_per_node"]
    cfg["disaggregation"] = {"prefill": {"parallel": {"tp": 2}}, "decode": {"parallel": {"dp": 2}}}
    config.write_text(yaml.safe_dump(cfg))
    done = launch(config)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "disaggregation: KV moves over mooncake-tcp" in done.stderr
    assert results(tmp_path / "results.jsonl") == reference
    pids = [int(pid) for *_, pid in RANK_LINE.findall(done.stderr)]
    assert len(pids) == 4  # two ranks per part
    assert_gone(pids)


@pytest.mark.slow
def test_serve_on_two_raylets_tp2_dp2_matches_one_process(tmp_path, checkpoint, reference, loopback_cluster):
    """`launch serve` on the Ray backend: concurrent clients get one process's greedy answers."""
    address, _ = loopback_cluster
    port = free_port()
    config = deployment(tmp_path, checkpoint, address, job={"mode": "serve"}, server={"port": port})
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moelaunch.launcher.cli", str(config)],
            cwd=REPO,
            env=node_env(),
            stderr=out,
        )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)

        def ask(prompt: object) -> str:
            route, field = (
                ("completions", "prompt") if isinstance(prompt, str) else ("chat/completions", "messages")
            )
            body = {"model": Path(checkpoint).name, field: prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            choice = httpx.post(f"{url}/{route}", json=body, timeout=60).json()["choices"][0]
            return choice["text"] if isinstance(prompt, str) else choice["message"]["content"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = dict(zip(PROMPTS, pool.map(ask, PROMPTS.values()), strict=True))
        tokenizer = Tokenizer.from_dir(checkpoint)
        assert answers == {k: tokenizer.decode(ids) for k, ids in reference.items()}
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    stderr = log.read_text()
    assert server.returncode == 0, stderr[-3000:]
    assert_gone([pid for _, pid in rank_table(stderr).values()])


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url.removesuffix("/v1") + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


# A batch that trickles out: one sequence per replica at a time, 32 tokens each, for several seconds.
TRICKLE = {f"r{i}": f"request number {i}" for i in range(8)}


def trickle_expected(checkpoint: str) -> dict[str, list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(checkpoint, max_model_len=128) as llm:
        outs = llm.generate(list(TRICKLE.values()), greedy)
    return {k: o.outputs[0].token_ids for k, o in zip(TRICKLE, outs, strict=True)}


def trickle_deployment(tmp_path: Path, checkpoint: str, address: str, **changes: object) -> Path:
    config = deployment(tmp_path, checkpoint, address, engine__max_num_seqs=1, job__max_tokens=32, **changes)
    write_prompts(tmp_path / "prompts.jsonl", TRICKLE, ignore_eos=True)  # in place of the default prompts
    return config


@dataclass
class RunningJob:
    proc: subprocess.Popen
    err: list[str]
    reader: threading.Thread

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait(self, timeout_s: float) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        self.reader.join(timeout=10)
        return rc


def start_until_results(config: Path, out: Path, netns: str | None = None) -> RunningJob:
    """`launch CONFIG` in the background, returned once all 4 ranks are up and 2 results are written."""
    proc = subprocess.Popen(
        [*netns_prefix(netns), sys.executable, "-m", "moelaunch.launcher.cli", str(config)],
        cwd=REPO,
        env=node_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    job = RunningJob(proc, err, reader)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        if len(rank_table(job.stderr)) == 4 and out.exists() and out.read_text().count("\n") >= 2:
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the job ended before the fault could be made:\n" + job.stderr[-3000:]
    return job


@pytest.mark.slow
def test_killed_rank_ends_the_job_and_a_rerun_resumes(tmp_path, checkpoint, loopback_cluster):
    address, _ = loopback_cluster
    expected = trickle_expected(checkpoint)
    config = trickle_deployment(tmp_path, checkpoint, address)
    out = tmp_path / "results.jsonl"
    job = start_until_results(config, out)
    table = rank_table(job.stderr)
    victim = 3  # a rank on the node that is not rank 0's
    ip, pid = table[victim]
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    rc = job.wait(timeout_s=60)
    stderr = job.stderr
    assert rc != 0
    assert time.monotonic() - killed_at < 20, "the dead rank was not noticed within seconds"
    assert f"rank {victim} on node {ip} (pid {pid}) stopped: its process died" in stderr, stderr[-3000:]
    assert_gone([p for _, p in table.values()])
    partial = results(out)
    assert 2 <= len(partial) < len(TRICKLE)

    done = launch(config, "--set", "engine.max_num_seqs=8")  # the rerun may batch differently
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{len(partial)} already in" in done.stdout
    assert results(out) == expected


@pytest.mark.slow
def test_too_few_nodes_times_out_with_what_is_missing(tmp_path, checkpoint, loopback_cluster):
    address, _ = loopback_cluster
    config = deployment(
        tmp_path, checkpoint, address, parallel__dp=3, cluster__nodes=3, cluster__timeouts={"startup_s": 10}
    )
    start = time.monotonic()
    done = launch(config, timeout_s=60)
    assert done.returncode != 0
    assert "within cluster.timeouts.startup_s = 10 s" in done.stderr, done.stderr[-3000:]
    assert "needed 3 node(s) x 2 CPU slot(s), one node each; the cluster has 2 node(s)" in done.stderr
    assert time.monotonic() - start < 10 + 20  # the timeout plus starting Python and joining Ray


@pytest.mark.slow
def test_nodes_sharing_an_ip_are_refused(tmp_path, checkpoint, loopback_cluster):
    # Last in this module: it adds a third raylet on the head's IP.
    address, nodes = loopback_cluster
    nodes.append(start_raylet("127.0.0.1", head=address))
    config = deployment(tmp_path, checkpoint, address, parallel__dp=3, cluster__nodes=3)
    done = launch(config, timeout_s=120)
    assert done.returncode != 0
    assert re.search(r"2 Ray nodes of the deployment share IP 127.0.0.1 .*--node-ip-address", done.stderr), (
        done.stderr[-3000:]
    )


@dataclass
class TwoHosts:
    """Two raylets, each in its own network namespace (a "host"), joined by one link."""

    address: str
    netns: tuple[str, str]
    nodes: list[Raylet]

    def restart_second_node(self) -> None:
        self.nodes[1] = start_raylet(SUBNET + ".2", head=self.address, netns=self.netns[1])


SUBNET = "10.201.0"


@pytest.fixture(scope="module")
def two_network_namespaces():
    if not isolated_network():
        pytest.skip("Ray tests run inside a network namespace with only lo (see .ci/run)")
    with two_hosts(SUBNET) as (host_a, host_b):
        port = 6380  # the namespaces are new: every port is free there
        address = f"{SUBNET}.1:{port}"
        hosts = TwoHosts(address, (host_a, host_b), [start_raylet(f"{SUBNET}.1", port=port, netns=host_a)])
        try:
            hosts.nodes.append(start_raylet(f"{SUBNET}.2", head=address, netns=host_b))
            yield hosts
        finally:
            for node in reversed(hosts.nodes):
                node.stop()
        assert not any(node.group_alive() for node in hosts.nodes)


@pytest.mark.slow
def test_two_network_namespaces_tp2_dp2_match_one_process(
    tmp_path, checkpoint, reference, two_network_namespaces
):
    hosts = two_network_namespaces
    config = deployment(tmp_path, checkpoint, hosts.address, cluster__env={"GLOO_SOCKET_IFNAME": "eth1"})
    done = launch(config, netns=hosts.netns[0])
    assert done.returncode == 0, done.stderr[-3000:]
    assert results(tmp_path / "results.jsonl") == reference
    table = rank_table(done.stderr)
    assert {ip for ip, _ in table.values()} == {f"{SUBNET}.1", f"{SUBNET}.2"}


@pytest.mark.slow
def test_a_stopped_node_ends_the_job_naming_it_and_a_rerun_resumes(
    tmp_path, checkpoint, two_network_namespaces
):
    hosts = two_network_namespaces
    expected = trickle_expected(checkpoint)
    env = {"GLOO_SOCKET_IFNAME": "eth1", "OMP_NUM_THREADS": "1"}
    config = trickle_deployment(tmp_path, checkpoint, hosts.address, cluster__env=env)
    out = tmp_path / "results.jsonl"
    job = start_until_results(config, out, netns=hosts.netns[0])
    table = rank_table(job.stderr)
    stopped_at = time.monotonic()
    hosts.nodes[1].stop()  # the second host's raylet and everything it started, as a node going down
    rc = job.wait(timeout_s=90)
    stderr = job.stderr
    assert rc != 0
    assert time.monotonic() - stopped_at < 60, "the lost node was not noticed within the call timeout"
    lost = [r for r, (ip, _) in table.items() if ip == f"{SUBNET}.2"]
    assert re.search(rf"rank ({'|'.join(map(str, lost))}) on node {SUBNET}.2 \(pid \d+\) stopped", stderr), (
        stderr[-3000:]
    )
    assert "Traceback" not in stderr, stderr[-3000:]
    assert_gone([p for _, p in table.values()])
    partial = results(out)
    assert 2 <= len(partial) < len(TRICKLE)

    hosts.restart_second_node()
    done = launch(config, "--set", "engine.max_num_seqs=8", netns=hosts.netns[0])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{len(partial)} already in" in done.stdout
    assert results(out) == expected


@pytest.mark.slow
def test_a_cut_link_ends_the_job_naming_the_unreachable_rank_and_a_rerun_resumes(
    tmp_path, checkpoint, two_network_namespaces
):
    """The second host's link goes down (its veth set down in its namespace): nothing dies on its own, the
    peers just stop hearing from it. The job must end within the collective timeout, naming a rank on
    that host, and a rerun after the link is back completes the batch."""
    hosts = two_network_namespaces
    expected = trickle_expected(checkpoint)
    collective_s = 30
    env = {"GLOO_SOCKET_IFNAME": "eth1", "OMP_NUM_THREADS": "1"}
    timeouts = {"startup_s": 90, "collective_s": collective_s}
    config = trickle_deployment(
        tmp_path, checkpoint, hosts.address, cluster__env=env, cluster__timeouts=timeouts
    )
    out = tmp_path / "results.jsonl"
    job = start_until_results(config, out, netns=hosts.netns[0])
    table = rank_table(job.stderr)
    link = ["ip", "-n", hosts.netns[1], "link", "set", "eth1"]
    cut_at = time.monotonic()
    subprocess.run([*link, "down"], check=True)
    try:
        rc = job.wait(timeout_s=collective_s + 60)
        noticed_s = time.monotonic() - cut_at
    finally:
        subprocess.run([*link, "up"], check=True)
    stderr = job.stderr
    assert rc != 0
    # the call timeout (collective_s), PING_S to find the silent node, then the shutdown
    assert noticed_s < collective_s + 15, f"the cut link was noticed after {noticed_s:.0f} s"
    cut_off = [r for r, (ip, _) in table.items() if ip == f"{SUBNET}.2"]
    named = re.search(r"launch: error: (.*) stopped answering: the node did not run", stderr)
    assert named, stderr[-3000:]
    assert set(map(int, re.findall(rf"rank (\d+) on node {SUBNET}.2", named[1]))) == set(cut_off)
    assert "Traceback" not in stderr, stderr[-3000:]
    partial = results(out)
    assert 2 <= len(partial) < len(TRICKLE)

    hosts.nodes[1].stop()  # the raylet that lost its head meanwhile (if it has not exited yet)
    hosts.restart_second_node()
    done = launch(config, "--set", "engine.max_num_seqs=8", netns=hosts.netns[0])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{len(partial)} already in" in done.stdout
    assert results(out) == expected
