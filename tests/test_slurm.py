"""`launch slurm --dry-run`: the sbatch script asks for what the YAML says (nodes, CPU slots or GPUs,
time, partition, account, extra options), brings Ray up across the allocation with symmetric-run, and
runs the same deployment file there on the ray backend; a layout that cannot work is refused first."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from launcher.cli import main

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
    assert f"-m launcher.cli {config.resolve()} --set job.max_tokens=16 --set cluster.backend=ray" in script
    assert '--set cluster.address="$address"' in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid bash


def test_gpu_script_asks_for_gpus(tmp_path, capsys):
    cluster = {"nodes": 2, "devices_per_node": 8, "device": "cuda", "device_memory_gb": 141}
    config = write_config(tmp_path, "deepseek-v3-671b.json", {"tp": 8, "dp": 2}, cluster)
    script = dry_run(capsys, config, "--set", "dtype=fp8")
    assert "#SBATCH --gpus-per-node=8" in script and "--cpus-per-task" not in script
    assert "--num-cpus" not in script  # Ray counts the GPUs itself


def test_layout_that_cannot_work_is_refused_before_submitting(tmp_path, capsys):
    cluster = {"nodes": 2, "devices_per_node": 2, "device": "cpu", "device_memory_gb": 4}
    config = write_config(tmp_path, "tiny-v3.json", {"tp": 2, "dp": 1}, cluster)
    assert main(["slurm", str(config), "--dry-run"]) == 1
    captured = capsys.readouterr()
    assert "launch slurm: error:" in captured.err and "cluster.nodes: 1" in captured.err
    assert "#SBATCH" not in captured.out
