"""A deployment as a Slurm batch job: the sbatch script that starts Ray across the allocation and runs
the deployment on it, and running that script's body inside an allocation this process is already in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moelaunch.cluster.errors import ClusterError
from moelaunch.cluster.slurm.script import ADDRESS, SbatchJob
from moelaunch.launcher.deploy.config import DeployConfig


def sbatch_job(cfg: DeployConfig, config: Path, overrides: list[str]) -> SbatchJob:
    c = cfg.cluster
    gpus = c.slurm.gpus_per_node if c.slurm.gpus_per_node is not None else c.devices_per_node
    gpus = 0 if c.device == "cpu" else gpus
    # Inside the job the same file runs on the Ray cluster the script starts.
    sets = [*overrides, "cluster.backend=ray", f"cluster.address={ADDRESS}"]
    command = [sys.executable, "-m", "moelaunch.launcher.cli", str(config.resolve())]
    command += [arg for s in sets for arg in ("--set", s)]
    return SbatchJob(
        name=f"moelaunch-{config.stem}",
        nodes=c.nodes,
        slots_per_node=c.devices_per_node,
        gpus_per_node=gpus,
        time=c.slurm.time,
        command=command,
        workdir=str(Path.cwd()),
        partition=c.slurm.partition,
        account=c.slurm.account,
        extra_args=c.slurm.extra_args,
    )


def run_in_allocation(job: SbatchJob, environ: dict[str, str] | None = None) -> int:
    """Run the sbatch script's body (Ray across the nodes, the deployment on the first) inside the
    allocation this process runs in; returns the body's exit status."""
    env = dict(os.environ if environ is None else environ)
    if "SLURM_JOB_ID" not in env:
        raise ClusterError(
            "--here runs inside a Slurm allocation (SLURM_JOB_ID is not set): use salloc or sbatch"
        )
    # The body makes this node Ray's head and srun puts a node of Ray on the allocation's first nodes:
    # from a login node (salloc without a shell on the nodes) the head would be outside the allocation.
    if "SLURMD_NODENAME" not in env:
        raise ClusterError(
            f"--here must run on a node of job {env['SLURM_JOB_ID']} (SLURMD_NODENAME is not set): "
            "e.g. `srun --nodes 1 --ntasks 1 launch slurm CONFIG --here`, or in the job's batch script"
        )
    have = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 0)
    if have < job.nodes:
        raise ClusterError(
            f"cluster.nodes is {job.nodes} but job {env['SLURM_JOB_ID']} has {have} node(s) "
            f"({env.get('SLURM_JOB_NODELIST', '?')})"
        )
    # No timeout: the job's own time limit bounds it, as it bounds the sbatch script.
    return subprocess.run(["bash", "-c", job.body()], cwd=job.workdir, env=env, check=False).returncode
