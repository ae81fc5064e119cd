"""`launch serve [CONFIG.yaml] [--set key.path=value ...]`: the deployment as an OpenAI-compatible
server (its `job` becomes `{mode: serve}`; the `server` section sets host, port, API key, queue)."""

from __future__ import annotations

import argparse

from moelaunch.launcher.commands import add_deployment_arguments
from moelaunch.launcher.deploy.config import load_deploy_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a deployment over the OpenAI API (chat, completions, metrics)")
    add_deployment_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moelaunch.launcher.jobs.run import run_deployment

    overrides = ["job.mode=serve", *args.overrides]
    return run_deployment(load_deploy_config(args.config, overrides), overrides)
