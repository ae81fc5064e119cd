"""`launch slurm CONFIG.yaml [--set key.path=value ...] [--dry-run]`: write the sbatch script that runs
the deployment on a Ray cluster spanning a Slurm allocation (cluster.nodes nodes, cluster.slurm's
time, partition, account, GPUs), submit it and print the job id; --dry-run prints the script only."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.slurm_script import ADDRESS, SbatchJob, submit

from .deploy_config import DeployConfig, load_deploy_config
from .plan import build_plan


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slurm", help="submit a deployment as a Slurm batch job (Ray across its nodes)")
    p.add_argument("config", help="cluster YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script; submit nothing")
    p.add_argument("--script", help="where to write the script (default: ./<config name>.sbatch)")
    p.set_defaults(func=run)


def sbatch_job(cfg: DeployConfig, config: Path, overrides: list[str]) -> SbatchJob:
    c = cfg.cluster
    gpus = c.slurm.gpus_per_node if c.slurm.gpus_per_node is not None else c.devices_per_node
    gpus = 0 if c.device == "cpu" else gpus
    # Inside the job the same file runs on the Ray cluster the script starts.
    sets = [*overrides, "cluster.backend=ray", f"cluster.address={ADDRESS}"]
    command = [sys.executable, "-m", "launcher.cli", str(config.resolve())]
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


def run(args: argparse.Namespace) -> int:
    cfg = load_deploy_config(args.config, args.overrides)
    plan = build_plan(cfg)  # a layout that cannot work fails here, not after hours in the queue
    if not plan.fits:
        raise ValueError(f"{plan.verdict()}; details: `launch plan {cfg.source}`")
    job = sbatch_job(cfg, Path(args.config), args.overrides)
    script = job.script()
    if args.dry_run:
        print(script, end="")
        return 0
    path = Path(args.script or f"{Path(args.config).stem}.sbatch").resolve()
    path.write_text(script)
    job_id = submit(path)
    print(f"submitted Slurm job {job_id} ({path}); output: {job.workdir}/{job.name}-{job_id}.out")
    return 0
