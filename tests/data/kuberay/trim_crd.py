"""Regenerate the KubeRay schemas the k8s tests check against, from KubeRay's CRDs:

    python tests/data/kuberay/trim_crd.py KUBERAY_CHECKOUT v1.7.0

Each CRD's v1 openAPIV3Schema is kept with its descriptions dropped and the embedded Kubernetes types
(pod templates, resources, volumes...) cut to their type: the tests check those with the kubernetes
client's own models instead. KubeRay is Apache-2.0 (https://github.com/ray-project/kuberay)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

CRDS = {"rayjob": "ray.io_rayjobs.yaml", "raycluster": "ray.io_rayclusters.yaml"}
POD_TEMPLATES = {"template", "submitterPodTemplate"}
KUBERNETES_TYPES = {"resources", "volumes", "affinity", "tolerations", "securityContext", "env"}
KUBERNETES_TYPES |= {"volumeMounts", "envFrom", "submitterConfig", "autoscalerOptions"}


def trim(node: Any) -> Any:
    if isinstance(node, list):
        return [trim(x) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "description":
            continue
        if key != "properties":
            out[key] = trim(value)
            continue
        out[key] = {}
        for name, sub in value.items():
            if name in POD_TEMPLATES or name in KUBERNETES_TYPES:
                out[key][name] = {"type": sub.get("type", "object")}
            else:
                out[key][name] = trim(sub)
    return out


def main(checkout: str, tag: str) -> None:
    here = Path(__file__).parent
    for kind, file in CRDS.items():
        text = subprocess.run(
            ["git", "-C", checkout, "show", f"{tag}:ray-operator/config/crd/bases/{file}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        crd = yaml.safe_load(text)
        (version,) = (v for v in crd["spec"]["versions"] if v["name"] == "v1")
        schema = {"kuberay": tag, **trim(version["schema"]["openAPIV3Schema"])}
        (here / f"{kind}.v1.json").write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
