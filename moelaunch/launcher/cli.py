"""The `launch` command: `launch [CONFIG.yaml] [--set key=value ...]` runs a deployment (by default
the embedded configs/local.yaml); `launch SUBCOMMAND ...` runs a tool.

Each subcommand lives in its own module exposing `register(subparsers)`; adding one is one line in
SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moelaunch.cluster.errors import ClusterError

# name -> module that defines it (imported only when used, so `launch --help` stays fast)
SUBCOMMANDS: dict[str, str] = {
    "batch": "moelaunch.launcher.commands.batch",
    "bench": "moelaunch.launcher.commands.bench",
    "convert": "moelaunch.launcher.commands.convert",
    "distill": "moelaunch.launcher.commands.distill",
    "eval": "moelaunch.launcher.commands.eval",
    "k8s": "moelaunch.launcher.commands.k8s",
    "plan": "moelaunch.launcher.commands.plan",
    "prune": "moelaunch.launcher.commands.prune",
    "report": "moelaunch.launcher.commands.report",
    "serve": "moelaunch.launcher.commands.serve",
    "slurm": "moelaunch.launcher.commands.slurm",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch",
        description="Place and run DeepSeek-V3-architecture MoE models. With no arguments: a local demo.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        if only is None or only == name:
            importlib.import_module(module).register(sub)
    return parser


def deployment_parser() -> argparse.ArgumentParser:
    from moelaunch.launcher.commands import add_deployment_arguments

    p = argparse.ArgumentParser(
        prog="launch", description="Run the deployment a cluster YAML file describes."
    )
    add_deployment_arguments(p)
    p.epilog = f"Tools: launch {{{','.join(SUBCOMMANDS)}}} --help"
    return p


def run_deployment_command(argv: list[str]) -> int:
    from moelaunch.launcher.deploy.config import load_deploy_config
    from moelaunch.launcher.jobs.run import run_deployment

    args = deployment_parser().parse_args(argv)
    return run_deployment(load_deploy_config(args.config, args.overrides), args.overrides)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    try:
        if command is None:
            return run_deployment_command(argv)
        args = build_parser(command).parse_args(argv)
        return int(args.func(args) or 0)
    except (ValueError, ClusterError) as e:
        # User-caused errors (bad paths, configs, checkpoints, dead nodes) carry a message naming the fix.
        print(f"launch{' ' + command if command else ''}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a path no check foresaw (missing, unreadable, a device): one line naming it
        print(f"launch{' ' + command if command else ''}: error: {os_error_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C: one line (a job may say how to resume), no traceback
        print(f"launch{' ' + command if command else ''}: {str(e) or 'interrupted'}", file=sys.stderr)
        return 130


def os_error_line(e: OSError) -> str:
    if e.filename is None:  # raised by our own checks with a full message
        return str(e)
    if isinstance(e, PermissionError):
        return (
            f"{e.filename}: permission denied for this user; fix its permissions (or those of a directory "
            "above it) or choose another path"
        )
    return f"{e.filename}: {e.strerror or e}; check the path, or choose another"


if __name__ == "__main__":
    raise SystemExit(main())
