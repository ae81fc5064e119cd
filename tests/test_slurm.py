"""`launch slurm --dry-run`: the sbatch script asks for what the YAML says (nodes, CPU slots or GPUs,
time, partition, account, extra options), brings Ray up across the allocation with symmetric-run, and
runs the same deployment file there on the ray backend; a layout that cannot work is refused first."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray_nodes import node_env
from slurm_cluster import missing_slurm, slurm_cluster
from tiny_models import add_byte_tokenizer, make_hf_model
from tokenizers import Tokenizer

from moelaunch.cluster.rendezvous import free_port
from moelaunch.launcher.cli import main

REPO = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path, model: str, parallel: dict, cluster: dict) -> Path:
    cfg = {
        "model": str(REPO / "configs" / "models" / model),
        "parallel": parallel,
        "cluster": {"backend": "slurm", **cluster},
        "job": {"mode": "batch", "input": "prompts.jsonl", "output": "results.jsonl"},
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def dry_run(capsys, config: Path, *args: str) -> str:
    assert main(["slurm", str(config), "--dry-run", *args]) == 0
    return capsys.readouterr().out


def test_cpu_script_asks_for_slots_and_runs_the_file_on_ray(tmp_path, capsys):
    slurm = {"partition": "debug", "account": "acct", "time": "00:10:00", "extra_args": ["--qos=high"]}
    cluster = {"nodes": 2, "devices_per_node": 2, "device": "cpu", "device_memory_gb": 4, "slurm": slurm}
    config = write_config(tmp_path, "tiny-v3.json", {"tp": 2, "dp": 2}, cluster)
    script = dry_run(capsys, config, "--set", "job.max_tokens=16")
    directives = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")]
    for want in ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", "--time=00:10:00"]:
        assert want in directives
    for want in ["--partition=debug", "--account=acct", "--qos=high", "--requeue"]:
        assert want in directives
    assert not any(d.startswith("--gpus-per-node") for d in directives)
    assert 'symmetric-run --min-nodes 2 --num-cpus=2 --address "$address" --' in script
    assert (
        f"-m moelaunch.launcher.cli {config.resolve()} --set job.max_tokens=16 --set cluster.backend=ray"
        in script
    )
    assert '--set cluster.address="$address"' in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid bash


def test_gpu_script_asks_for_gpus(tmp_path, capsys):
    cluster = {"nodes": 2, "devices_per_node": 8, "device": "cuda", "device_memory_gb": 141}
    config = write_config(tmp_path, "deepseek-v3-671b.json", {"tp": 8, "dp": 2}, cluster)
    script = dry_run(capsys, config, "--set", "dtype=fp8")
    assert "#SBATCH --gpus-per-node=8" in script and "--cpus-per-task" not in script
    assert "--num-cpus" not in script  # Ray counts the GPUs itself


@pytest.mark.parametrize(
    "override",
    # YAML double quotes: "\n" is a real line break in the value.
    ['cluster.slurm.partition="gpu\\necho INJECTED"', "cluster.slurm.account='a;touch /tmp/x'",
     "cluster.slurm.partition='$(reboot)'", 'cluster.slurm.extra_args=["--qos=high\\nrm -rf ~"]',
     "cluster.slurm.extra_args=['--qos=\"x y\"']", 'cluster.slurm.time="01:00:00\\nid"'],
)  # fmt: skip
def test_values_that_would_break_out_of_the_script_are_refused(tmp_path, capsys, override):
    cluster = {"nodes": 2, "devices_per_node": 2, "device": "cpu", "device_memory_gb": 4}
    config = write_config(tmp_path, "tiny-v3.json", {"tp": 2, "dp": 2}, cluster)
    assert main(["slurm", str(config), "--dry-run", "--set", override]) == 1
    captured = capsys.readouterr()
    assert "launch slurm: error:" in captured.err and "cluster.slurm." in captured.err
    assert "#SBATCH" not in captured.out


def test_layout_that_cannot_work_is_refused_before_submitting(tmp_path, capsys):
    cluster = {"nodes": 2, "devices_per_node": 2, "device": "cpu", "device_memory_gb": 4}
    config = write_config(tmp_path, "tiny-v3.json", {"tp": 2, "dp": 1}, cluster)
    assert main(["slurm", str(config), "--dry-run"]) == 1
    captured = capsys.readouterr()
    assert "launch slurm: error:" in captured.err and "cluster.nodes: 1" in captured.err
    assert "#SBATCH" not in captured.out


def test_here_outside_an_allocation_says_so(tmp_path, capsys, monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURMD_NODENAME", "SLURM_JOB_NUM_NODES"):
        monkeypatch.delenv(var, raising=False)
    cluster = {"nodes": 2, "devices_per_node": 2, "device": "cpu", "device_memory_gb": 4}
    config = write_config(tmp_path, "tiny-v3.json", {"tp": 2, "dp": 2}, cluster)
    assert main(["slurm", str(config), "--here"]) == 1
    assert "--here runs inside a Slurm allocation (SLURM_JOB_ID is not set)" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert main(["slurm", str(config), "--here"]) == 1
    assert "must run on a node of job 7 (SLURMD_NODENAME is not set)" in capsys.readouterr().err
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    assert main(["slurm", str(config), "--here"]) == 1
    assert "cluster.nodes is 2 but job 7 has 1 node(s)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "script, says",
    [("{tmp}", "is a directory: give a file path"), ("{tmp}/no/dir/job.sbatch", "does not exist; create it")],
)
def test_a_script_path_that_cannot_be_written_is_refused(tmp_path, capsys, script, says):
    cluster = {"nodes": 2, "devices_per_node": 2, "device": "cpu", "device_memory_gb": 4}
    config = write_config(tmp_path, "tiny-v3.json", {"tp": 2, "dp": 2}, cluster)
    assert main(["slurm", str(config), "--script", script.format(tmp=tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"launch slurm: error: --script {script.format(tmp=tmp_path)}") and says in err


def test_no_sbatch_says_what_to_install_and_how_to_only_write_the_script(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # Slurm's client tools are not installed
    cluster = {"nodes": 2, "devices_per_node": 2, "device": "cpu", "device_memory_gb": 4}
    config = write_config(tmp_path, "tiny-v3.json", {"tp": 2, "dp": 2}, cluster)
    script = tmp_path / "job.sbatch"
    assert main(["slurm", str(config), "--script", str(script)]) == 1
    err = capsys.readouterr().err
    assert "sbatch not found on PATH" in err and "slurm-client" in err and "--dry-run > job.sbatch" in err
    assert err.count("\n") == 1 and not script.exists()


# --- a real Slurm: two emulated nodes, each in its own network namespace ------------------------

PROMPTS = {"a": "hello world", "b": "the quick brown fox", "c": "moelaunch", "d": "12+34="}
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def slurm():
    reason = missing_slurm()
    if reason:
        pytest.skip(reason)
    with slurm_cluster() as cluster:
        assert cluster.leftovers(), "leftovers() must see the running daemons, or its check below is void"
        yield cluster
    # The PID namespace took every daemon, job step and Ray process with it.
    assert not cluster.leftovers(), "a process of the test Slurm outlived it"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny")
    return str(add_byte_tokenizer(make_hf_model(path, "v3", num_hidden_layers=2)))


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[str, list[int]]:
    """Greedy token ids from one process: what the two-node job must reproduce."""
    from moelaunch.launcher import LLM, SamplingParams

    with LLM(checkpoint, max_model_len=128) as llm:
        outs = llm.generate(list(PROMPTS.values()), SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {k: o.outputs[0].token_ids for k, o in zip(PROMPTS, outs, strict=True)}


def batch_deployment(tmp_path: Path, checkpoint: str) -> Path:
    """tp2 x dp2 over 2 nodes x 2 CPU slots, a batch job over PROMPTS."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "prompt": p}) + "\n" for k, p in PROMPTS.items()))
    cfg = {
        "model": checkpoint,
        "parallel": {"tp": 2, "dp": 2},
        "engine": {"max_model_len": 128, "max_num_seqs": 4},
        "cluster": {
            "backend": "slurm",
            "nodes": 2,
            "devices_per_node": 2,
            "device": "cpu",
            # Both node namespaces name their link eth1; gloo must not advertise 127.0.0.1.
            "env": {"GLOO_SOCKET_IFNAME": "eth1", "OMP_NUM_THREADS": "1"},
            "timeouts": {"startup_s": 120, "collective_s": 60},
            "slurm": {"time": "00:05:00"},
        },
        "job": {
            "mode": "batch",
            "input": str(prompts),
            "output": str(tmp_path / "results.jsonl"),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        },
    }
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def job_env(slurm) -> dict[str, str]:
    # sbatch exports this environment to the job: the checkout on PYTHONPATH, Ray's files in the
    # cluster's state dir (not the machine's /tmp/ray).
    return node_env(RAY_TMPDIR=str(slurm.state / "ray"))


def finish(slurm, job_id: str, out_file: Path, timeout_s: float = 180) -> str:
    """Wait for the job; fail with its output unless it completed. Returns the output."""
    try:
        state = slurm.wait_job(job_id, timeout_s=timeout_s)
    finally:
        output = out_file.read_text(errors="replace") if out_file.exists() else "(no job output)"
        print(output[-4000:])  # shown by pytest when the test fails
    assert state in (None, "COMPLETED"), f"job {job_id} ended {state}:\n{output[-4000:]}\n{slurm.logs()}"
    return output


def assert_results(path: Path, reference: dict[str, list[int]], output: str) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(PROMPTS), "every id exactly once"
    assert {r["id"]: r["token_ids"] for r in rows} == reference
    # Ray really spanned both nodes' addresses, head on the first.
    assert "Ray head at 10.202.0.1:" in output
    ranks = re.findall(r"ray: rank \d+ on node ([\d.]+)", output)
    assert sorted(set(ranks)) == ["10.202.0.1", "10.202.0.2"], output[-3000:]


@pytest.mark.slow
def test_launch_slurm_runs_a_two_node_batch_job(tmp_path, slurm, checkpoint, reference):
    config = batch_deployment(tmp_path, checkpoint)
    cmd = [sys.executable, "-m", "moelaunch.launcher.cli", "slurm", str(config)]
    done = slurm.client(cmd, env=job_env(slurm), timeout_s=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    job_id = re.search(r"submitted Slurm job (\d+)", done.stdout).group(1)
    output = finish(slurm, job_id, tmp_path / f"moelaunch-deploy-{job_id}.out")
    assert_results(tmp_path / "results.jsonl", reference, output)


# Run from the first node's network: waits for the server, asks each prompt greedily, prints the texts.
SERVE_CLIENT = """
import json, sys, time, httpx
url, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + 150
while True:
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            break
    except httpx.TransportError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the server did not come up")
    time.sleep(1)
texts = {}
for key, prompt in prompts.items():
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    texts[key] = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
print(json.dumps(texts))
"""


@pytest.mark.slow
def test_a_server_runs_inside_the_allocation_it_is_given(tmp_path, slurm, checkpoint, reference):
    """`launch slurm --here` in an allocation made by hand (as salloc or a user's own script would),
    serving: the OpenAI server on the first node answers what one process answers. (A batch job through
    `launch slurm`'s own script: the test above.)"""
    config = batch_deployment(tmp_path, checkpoint)
    port = free_port()
    serve = ["job={mode: serve}", f"server={{port: {port}, served_model_name: tiny}}"]
    launch = f"{sys.executable} -m moelaunch.launcher.cli slurm {config} --here " + " ".join(
        f"--set '{s}'" for s in serve
    )
    out_file = tmp_path / "allocation.out"
    sbatch = ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2"]
    sbatch += [f"--output={out_file}", "--time=00:05:00", f"--wrap={launch}"]
    done = slurm.client(sbatch, env=job_env(slurm), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().split(";")[0]
    try:
        asked = slurm.client(
            [
                sys.executable,
                "-c",
                SERVE_CLIENT,
                f"http://127.0.0.1:{port}",
                json.dumps(PROMPTS),
                str(MAX_TOKENS),
            ],
            env=job_env(slurm),
            timeout_s=240,
        )
    finally:
        slurm.client(["scancel", job_id])
        state = slurm.wait_job(job_id, timeout_s=60)
        output = out_file.read_text(errors="replace") if out_file.exists() else "(no job output)"
    assert asked.returncode == 0, f"{asked.stderr[-2000:]}\n{output[-3000:]}\n{slurm.logs()}"
    tokenizer = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
    assert json.loads(asked.stdout) == {k: tokenizer.decode(ids) for k, ids in reference.items()}
    assert state in (None, "CANCELLED"), state
    ranks = re.findall(r"ray: rank \d+ on node ([\d.]+)", output)
    assert sorted(set(ranks)) == ["10.202.0.1", "10.202.0.2"], output[-3000:]
