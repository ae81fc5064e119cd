"""`launch k8s CONFIG.yaml --image IMAGE [--namespace NS] [--volume CLAIM:/PATH ...] [-o FILE]`: write the
KubeRay objects that run the deployment on Kubernetes (see docs/kubernetes.md); print them, or write them
to FILE, for `kubectl apply -f`."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from moelaunch.launcher.commands import add_deployment_arguments, count
from moelaunch.launcher.deploy.config import load_deploy_config
from moelaunch.launcher.deploy.k8s import K8sOptions, Volume, manifests, to_yaml
from moelaunch.launcher.deploy.plan import build_plan
from moelaunch.launcher.jobs.output_path import check_writable

# RFC 1123 label: the object names are used as DNS names (the Service, the head's service)
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?$")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("k8s", help="write KubeRay manifests (RayJob / RayCluster) for a deployment")
    add_deployment_arguments(p, config_required=True)
    p.add_argument("--image", required=True, help="a container image with moelaunch and ray installed")
    p.add_argument("--namespace", default="default", type=_dns_label)
    p.add_argument("--name", default="moelaunch", type=_dns_label, help="prefix of every object's name")
    p.add_argument("--model-path", help="the checkpoint directory inside the pods (default: `model`)")
    p.add_argument(
        "--volume",
        dest="volumes",
        action="append",
        default=[],
        type=Volume.parse,
        metavar="CLAIM:/PATH",
        help="mount a PersistentVolumeClaim at PATH in every pod (repeatable)",
    )
    p.add_argument("--cpus-per-rank", type=count, default=8, help="CPU cores requested per rank")
    p.add_argument(
        "--api-key-secret", type=_dns_label, help="a Secret whose key `api-key` the server requires"
    )
    p.add_argument("-o", "--output", help="write the manifests here instead of printing them")
    p.set_defaults(func=run)


def _dns_label(text: str) -> str:
    if not DNS_LABEL.match(text):
        raise argparse.ArgumentTypeError(f"{text!r}: lowercase letters, digits and '-', at most 42")
    return text


def run(args: argparse.Namespace) -> int:
    cfg = load_deploy_config(args.config, args.overrides)
    plan = build_plan(cfg)
    if not plan.fits:
        raise ValueError(f"{plan.verdict()}; details: `launch plan {cfg.source}`")
    options = K8sOptions(
        image=args.image,
        namespace=args.namespace,
        name=args.name,
        model_path=args.model_path,
        volumes=tuple(args.volumes),
        cpus_per_rank=args.cpus_per_rank,
        api_key_secret=args.api_key_secret,
    )
    objects = manifests(plan, options)
    if args.output is None:
        sys.stdout.write(to_yaml(objects))
        return 0
    check_writable(Path(args.output), "--output")  # a directory or a read-only place: one line, no traceback
    Path(args.output).write_text(to_yaml(objects))
    kinds = ", ".join(obj["kind"] for obj in objects)
    print(f"wrote {kinds} to {args.output}; apply with `kubectl apply -f {args.output}`")
    return 0
