"""A Slurm batch job that runs one command on a Ray cluster spanning its allocation: the script asks
for the nodes, then `srun` starts `ray symmetric-run` on every node, which brings Ray up (head on the
first node), runs the command there with the head's address, and stops Ray everywhere when it ends."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from moelaunch.cluster.errors import ClusterError

RAY = str(Path(sys.executable).with_name("ray"))  # the driver's environment; nodes share the filesystem
ADDRESS = "{ADDRESS}"  # in `command`: replaced by the head's HOST:PORT inside the job
# Slurm's KillWait before SIGKILL is 30 s by default; Ray workers on other nodes must not outlive it.
NODE_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s=5"


@dataclass(frozen=True)
class SbatchJob:
    name: str
    nodes: int
    slots_per_node: int  # CPU slots (device cpu) or GPUs per node
    gpus_per_node: int  # 0 on CPU-only deployments
    time: str
    command: list[str]  # run once, on the first node, with ADDRESS replaced
    workdir: str
    partition: str | None = None
    account: str | None = None
    extra_args: list[str] = field(default_factory=list)

    def script(self) -> str:
        directives = [
            f"--job-name={self.name}",
            f"--nodes={self.nodes}",
            "--ntasks-per-node=1",
            f"--time={self.time}",
            f"--chdir={self.workdir}",
            f"--output={self.name}-%j.out",
            # A preempted job is queued again; a batch job then resumes from its results file.
            "--requeue",
            "--open-mode=append",
        ]
        if self.gpus_per_node:
            directives.append(f"--gpus-per-node={self.gpus_per_node}")
        else:
            directives.append(f"--cpus-per-task={self.slots_per_node}")
        directives += [f"--partition={self.partition}"] * bool(self.partition)
        directives += [f"--account={self.account}"] * bool(self.account)
        directives += self.extra_args
        unsafe = [d for d in directives if any(c in d for c in "\n\r\0")]
        if unsafe:  # a line break would end the #SBATCH line and run the rest as a command
            raise ValueError(f"an #SBATCH option holds a line break: {unsafe[0]!r}")
        return "\n".join(["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), self.body()])

    def body(self) -> str:
        """The bash that runs on the allocation's first node: Ray across the nodes, the command on it.
        The sbatch script's body; `launch slurm --here` runs it inside an allocation made elsewhere."""
        ray_resources = [] if self.gpus_per_node else [f"--num-cpus={self.slots_per_node}"]
        command = " ".join(_shell_word(a) for a in self.command)
        symmetric = [RAY, "symmetric-run", "--min-nodes", str(self.nodes), *ray_resources]
        lines = [
            "set -euo pipefail",
            "export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}",
            "# The head is this (the first) node: its first address, and a port free on it.",
            "head_ip=$(hostname -I | awk '{print $1}')",
            f"port=$({shlex.quote(sys.executable)} -c 'import socket; s = socket.socket(); "
            's.bind(("", 0)); print(s.getsockname()[1])\')',
            'address="$head_ip:$port"',
            'echo "moelaunch: Ray head at $address on $(hostname), nodes: $SLURM_JOB_NODELIST"',
            f"srun --nodes={self.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
            f'  bash -c \'if [ "$SLURM_NODEID" != 0 ]; then export {NODE_ENV}; fi; exec "$@"\' _ \\',
            f'  {" ".join(shlex.quote(a) for a in symmetric)} --address "$address" -- \\',
            f"  {command}",
            "",
        ]
        return "\n".join(lines)


def _shell_word(arg: str) -> str:
    """arg quoted for bash, with ADDRESS expanded from the script's $address."""
    return '"$address"'.join(shlex.quote(part) if part else "" for part in arg.split(ADDRESS))


def check_sbatch(config: str) -> None:
    """Before the script is written: without sbatch there is nothing to submit it with."""
    if shutil.which("sbatch") is None:
        raise ClusterError(
            "sbatch not found on PATH: submitting needs Slurm's client tools (Debian/Ubuntu: apt install "
            "slurm-client, configured for your cluster), or run this on the cluster's login node. To only "
            f"write the script: launch slurm {config} --dry-run > job.sbatch, then sbatch job.sbatch where "
            "Slurm is installed"
        )


def submit(script_path: Path, timeout_s: float = 60) -> str:
    """sbatch the script; returns the job id."""
    try:
        done = subprocess.run(
            ["sbatch", "--parsable", str(script_path)], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise ClusterError(
            f"sbatch {script_path} gave no answer in {timeout_s:.0f} s: is slurmctld up?"
        ) from None
    if done.returncode != 0:
        raise ClusterError(f"sbatch {script_path} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]
