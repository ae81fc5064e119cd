"""The expert-placement file: where each MoE layer's routed experts live, copies included, as `launch plan
--expert-load ... --write-placement` writes it and the deployment's parallel.expert_placement_file names:

    {"format": "moelaunch-expert-placement/1", "ep": <EP ranks>, "n_routed_experts": <E>,
     "redundant_experts": <R>, "layers": {"<decoder layer index>": [[EP ranks holding expert e], ...]}}

Layers the file leaves out keep the deployment's global placement."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from moelaunch.model.config import ModelArgs
from moelaunch.parallel.expert_parallel import ExpertPlacement
from moelaunch.text.files import read_text

FORMAT = "moelaunch-expert-placement/1"
REWRITE = "write it again with `launch plan CONFIG --expert-load FILE --write-placement OUT.json`"


def write_placement_file(
    path: Path, placements: Mapping[int, ExpertPlacement], redundant_experts: int
) -> None:
    first = next(iter(placements.values()))
    path.write_text(
        json.dumps(
            {
                "format": FORMAT,
                "ep": first.ep_size,
                "n_routed_experts": len(first.owners),
                "redundant_experts": redundant_experts,
                "layers": {str(i): [list(r) for r in p.owners] for i, p in sorted(placements.items())},
            }
        )
        + "\n"
    )


def read_placement_file(path: Path, args: ModelArgs, ep: int) -> dict[int, ExpertPlacement]:
    """Decoder layer index -> placement, checked against the model and the layout's EP size; ValueError
    saying what is wrong and how to fix it."""
    what = "expert-placement file"
    try:
        data = json.loads(read_text(path, what))
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e}): {REWRITE}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"format is {found!r}, not {FORMAT!r}: {REWRITE}")
    if data.get("ep") != ep:
        raise ValueError(f"written for ep={data.get('ep')}, but this layout has ep = dp*tp = {ep}: {REWRITE}")
    if data.get("n_routed_experts") != args.n_routed_experts:
        raise ValueError(
            f"written for {data.get('n_routed_experts')} routed experts, the model has "
            f"{args.n_routed_experts}: {REWRITE}"
        )
    layers = data.get("layers")
    if not isinstance(layers, dict):
        raise ValueError(f"no 'layers' object: {REWRITE}")
    moe_layers = args.moe_layer_ids()
    placements = {}
    for key, owners in layers.items():
        layer = int(key) if key.isdigit() else -1
        if layer not in moe_layers:
            raise ValueError(f"layer {key!r} is not a MoE layer of the model: {REWRITE}")
        if not isinstance(owners, list) or not all(
            isinstance(r, list) and all(type(i) is int for i in r) for r in owners
        ):
            raise ValueError(f"layer {key}: owners must be lists of EP ranks: {REWRITE}")
        try:
            placements[layer] = ExpertPlacement.from_map(owners, args.n_routed_experts, ep)
        except ValueError as e:
            raise ValueError(f"layer {key}: {e}: {REWRITE}") from None
    return placements
