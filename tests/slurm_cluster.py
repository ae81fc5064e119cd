"""A real single-host Slurm for tests: munged, slurmctld and two slurmd "nodes" (n1, n2), each node in its
own network namespace with its own IP (ray symmetric-run and gloo need distinct node addresses), all
inside one PID namespace so that every daemon, job step and Ray process they started ends with the test.

Layout (see ../shared/RECIPES.md, "Slurm on one host"):
  netns A: eth1 SUBNET.1, slurmctld, slurmd n1        netns B: eth1 SUBNET.2, slurmd n2
joined by a veth pair. Clients (sbatch, squeue, the launcher) enter netns A with nsenter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ray_nodes import two_hosts

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "tests" / "slurm_setup.sh"
CTLD_PORT = 16817
NODE_PORTS = {"n1": 17001, "n2": 17002}
# Job states after which squeue has nothing more to wait for.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}


def missing_slurm() -> str | None:
    """Why a Slurm test cannot run here, or None; installs the Debian packages first when apt can."""
    if os.geteuid() != 0:
        return "a test Slurm needs root (network and PID namespaces, slurmd)"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} not found (iproute2 / util-linux)"
    apt = shutil.which("apt-get") is not None
    if shutil.which("slurmctld") is None and apt:
        # Normally .ci/run did this before the network was cut; try once more (works with a network).
        subprocess.run(["bash", str(SETUP)], capture_output=True, timeout=300, check=False)
    missing = [t for t in ("slurmctld", "slurmd", "sbatch", "squeue", "munged") if shutil.which(t) is None]
    if missing:
        how = "`bash tests/slurm_setup.sh` failed (no network?)" if apt else "no apt-get to install them"
        return f"Slurm test skipped: {', '.join(missing)} not installed and {how}"
    return None


def slurm_conf(state: Path, subnet: str, cpus: int) -> str:
    nodes = [
        f"NodeName={name} NodeHostname=localhost NodeAddr={subnet}.{i} Port={port} CPUs={cpus} "
        "RealMemory=1000 State=UNKNOWN"
        for i, (name, port) in enumerate(NODE_PORTS.items(), start=1)
    ]
    lines = [
        "ClusterName=moelaunch-test",
        # "localhost": slurmctld accepts it as its own name whatever the machine is called.
        f"SlurmctldHost=localhost({subnet}.1)",
        f"SlurmctldPort={CTLD_PORT}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # A private munged: its socket is ours, not the machine's.
        f"AuthInfo=socket={state}/munge.sock",
        "SlurmUser=root",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "MailProg=/bin/true",
        # Steps that ignore SIGTERM are killed 5 s later, not 30: the test is bounded.
        "KillWait=5",
        "InactiveLimit=0",
        f"StateSaveLocation={state}/ctld",
        f"SlurmdSpoolDir={state}/%n",
        f"SlurmctldPidFile={state}/slurmctld.pid",
        f"SlurmdPidFile={state}/%n.pid",
        f"SlurmctldLogFile={state}/slurmctld.log",
        f"SlurmdLogFile={state}/%n.log",
        *nodes,
        f"PartitionName=debug Nodes={','.join(NODE_PORTS)} Default=YES State=UP MaxTime=INFINITE",
    ]
    return "\n".join(lines) + "\n"


@dataclass
class SlurmCluster:
    state: Path  # conf, logs, spool dirs, munge socket
    conf: Path
    hosts: list[str]  # network namespaces of n1 (also slurmctld) and n2
    ips: list[str]
    proc: subprocess.Popen  # `unshare --pid`: its child is PID 1 of the namespace every daemon runs in

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def client(self, args: list[str], env: dict[str, str] | None = None, timeout_s: float = 30, **kw):
        """Run a client command (sbatch, squeue, the launcher) from the first node's network."""
        return subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.hosts[0]}", *args],
            env=self.env(env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            **kw,
        )

    def idle_nodes(self) -> set[str]:
        done = self.client(["sinfo", "-h", "-N", "-o", "%N %t"])
        return {name for name, st in (line.split() for line in done.stdout.splitlines()) if st == "idle"}

    def job_state(self, job_id: str) -> str | None:
        """The job's state, or None once slurmctld has forgotten it."""
        done = self.client(["squeue", "-h", "-j", job_id, "--states=all", "-o", "%T"])
        return done.stdout.strip() or None if done.returncode == 0 else None

    def wait_job(self, job_id: str, timeout_s: float) -> str | None:
        """Poll squeue until the job is over; returns its last state (None: already purged)."""
        deadline = time.monotonic() + timeout_s
        state = self.job_state(job_id)
        while state is not None and state not in FINAL_STATES:
            if time.monotonic() > deadline:
                self.client(["scancel", job_id])
                raise TimeoutError(f"Slurm job {job_id} still {state} after {timeout_s:.0f} s\n{self.logs()}")
            time.sleep(1)
            state = self.job_state(job_id)
        return state

    def logs(self, tail: int = 1500) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-tail:]}"
            for log in sorted([*self.state.glob("*.log"), *self.state.glob("*.out")])
        )

    def stop(self, timeout_s: float = 15) -> None:
        # unshare ignores SIGTERM while it waits for its child; SIGKILL it, and --kill-child SIGKILLs the
        # namespace's PID 1, upon which the kernel kills everything in the namespace (nested ones too).
        # Nothing here needs a graceful shutdown: the state dir is thrown away.
        self.proc.kill()
        self.proc.wait(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)  # the kernel tears the namespace down asynchronously

    def leftovers(self) -> list[int]:
        """Processes on the machine that still mention this cluster's state dir (daemons, job steps)."""
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                seen = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
            except OSError:
                continue
            if str(self.state).encode() in seen:
                pids.append(int(proc.name))
        return pids


def supervisor_script(state: Path, conf: Path, hosts: list[str]) -> str:
    """PID 1 of the cluster's PID namespace: start the daemons in the background and wait for them."""
    nsenter = [f"nsenter --net=/run/netns/{host}" for host in hosts]
    # Each node also gets its own PID namespace, as separate machines would: `ray stop` at the end of
    # `ray symmetric-run` kills Ray processes by name, and must only see its own node's. bash, not
    # slurmd, is the node's PID 1: it reaps the orphans (Ray's daemons) that slurmd would leave as
    # zombies, which `ray stop` then waits out for its whole grace period.
    nodes = [
        f"unshare --pid --fork --mount-proc --kill-child {nsenter[i]} "
        f"bash -c 'slurmd -D -f {conf} -N {name} & wait' >>{state}/{name}.out 2>&1 &"
        for i, name in enumerate(NODE_PORTS)
    ]
    return "\n".join(
        [
            "set -eu",
            f"export SLURM_CONF={conf}",
            # munged as root needs --force; a private key, socket, pid and seed file keep it to this test.
            f"munged --force --key-file={state}/munge.key --socket={state}/munge.sock "
            f"--pid-file={state}/munged.pid --seed-file={state}/munge.seed --log-file={state}/munged.log",
            f"{nsenter[0]} slurmctld -D -i -f {conf} >>{state}/slurmctld.out 2>&1 &",
            *nodes,
            "wait",
        ]
    )


@contextmanager
def slurm_cluster(subnet: str = "10.202.0", cpus: int = 2, timeout_s: float = 60) -> Iterator[SlurmCluster]:
    """A two-node Slurm (n1 at SUBNET.1, n2 at SUBNET.2), ready to run jobs; torn down on exit."""
    # Short, world-traversable path: munged checks its socket dir; Ray's socket paths stay short.
    state = Path(tempfile.mkdtemp(prefix="mls"))
    state.chmod(0o755)
    (state / "ctld").mkdir()
    for name in NODE_PORTS:
        (state / name).mkdir()
    key = state / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = state / "slurm.conf"
    conf.write_text(slurm_conf(state, subnet, cpus))
    with two_hosts(subnet) as hosts:
        script = supervisor_script(state, conf, hosts)
        with open(state / "supervisor.log", "wb") as log:  # the child keeps its own copy of the fd
            proc = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "bash", "-c", script],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        cluster = SlurmCluster(state, conf, hosts, [f"{subnet}.1", f"{subnet}.2"], proc)
        try:
            deadline = time.monotonic() + timeout_s
            while cluster.idle_nodes() != set(NODE_PORTS):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the test Slurm did not come up in {timeout_s:.0f} s\n{cluster.logs()}"
                    )
                time.sleep(0.5)
            yield cluster
        finally:
            cluster.stop()
            shutil.rmtree(state, ignore_errors=True)
