"""`launch slurm CONFIG.yaml [--set key.path=value ...] [--dry-run | --here]`: write the sbatch script
that runs the deployment on a Ray cluster spanning a Slurm allocation (cluster.nodes nodes,
cluster.slurm's time, partition, account, GPUs), submit it and print the job id; --dry-run prints the
script only; --here, inside an allocation (salloc, sbatch), runs the script's body on the allocation's
nodes directly instead of submitting a new job."""

from __future__ import annotations

import argparse
from pathlib import Path

from moelaunch.cluster.slurm.script import check_sbatch, submit
from moelaunch.launcher.commands import add_deployment_arguments
from moelaunch.launcher.deploy.config import load_deploy_config
from moelaunch.launcher.deploy.plan import build_plan
from moelaunch.launcher.deploy.slurm import run_in_allocation, sbatch_job
from moelaunch.launcher.jobs.output_path import check_writable


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slurm", help="submit a deployment as a Slurm batch job (Ray across its nodes)")
    add_deployment_arguments(p, config_required=True)
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script; submit nothing")
    p.add_argument("--script", help="where to write the script (default: ./<config name>.sbatch)")
    p.add_argument(
        "--here", action="store_true", help="inside an allocation: run on its nodes now instead of submitting"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_deploy_config(args.config, args.overrides)
    path = Path(args.script or f"{Path(args.config).stem}.sbatch").resolve()
    if not (args.dry_run or args.here):
        check_writable(path, "--script")
        check_sbatch(args.config)
    plan = build_plan(cfg)  # a layout that cannot work fails here, not after hours in the queue
    if not plan.fits:
        raise ValueError(f"{plan.verdict()}; details: `launch plan {cfg.source}`")
    job = sbatch_job(cfg, Path(args.config), args.overrides)
    if args.here:
        return run_in_allocation(job)
    script = job.script()
    if args.dry_run:
        print(script, end="")
        return 0
    try:
        path.write_text(script)
    except OSError as e:  # a device or full disk the writability check cannot foresee
        raise ValueError(f"--script {path}: cannot write it ({e.strerror or e}); choose another") from None
    job_id = submit(path)
    print(f"submitted Slurm job {job_id} ({path}); output: {job.workdir}/{job.name}-{job_id}.out")
    return 0
