"""The expert-load file: tokens routed to each expert of each MoE layer, as measured by `launch eval` or a
running engine and read by `launch plan --expert-load` (EPLB placement):

    {"format": "moelaunch-expert-load/1", "tokens": <tokens measured>,
     "counts": {"<decoder layer index>": [tokens per routed expert], ...}}

MTP layers are keyed by their checkpoint index (num_hidden_layers + k)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moelaunch.model.config import ModelArgs
from moelaunch.text.files import read_text

FORMAT = "moelaunch-expert-load/1"


@dataclass(frozen=True)
class ExpertLoadFile:
    tokens: int  # tokens measured (each goes to num_experts_per_tok experts per layer)
    layers: tuple[int, ...]  # decoder layer indices, ascending
    counts: torch.Tensor  # [len(layers), n_routed_experts] int64, row i for layers[i]


def write_expert_load(path: Path, tokens: int, counts: Mapping[int, Sequence[int] | torch.Tensor]) -> None:
    """Write counts (decoder layer index -> tokens per routed expert) in the format read_expert_load reads."""
    rows = {
        str(layer): [int(n) for n in (c.tolist() if isinstance(c, torch.Tensor) else c)]
        for layer, c in sorted(counts.items())
    }
    path.write_text(json.dumps({"format": FORMAT, "tokens": int(tokens), "counts": rows}) + "\n")


def read_expert_load(path: Path, args: ModelArgs) -> ExpertLoadFile:
    """The file's counts, checked against the model: ValueError naming the file, what is wrong and the fix.
    Every MoE decoder layer must be there; MTP layers may be."""
    what = "expert-load file"
    try:
        data = json.loads(read_text(path, what))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{what} {path}: not JSON ({e}); give a file written in the {FORMAT} format"
        ) from None
    fix = f"give a file written by `launch eval --expert-load-out` or the engine (format {FORMAT})"
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{what} {path}: format is {found!r}, not {FORMAT!r}: {fix}")
    tokens, counts = data.get("tokens"), data.get("counts")
    if type(tokens) is not int or tokens < 0 or not isinstance(counts, dict):
        raise ValueError(f"{what} {path}: needs an integer 'tokens' >= 0 and a 'counts' object: {fix}")
    moe = args.moe_layer_ids()
    if not moe:
        raise ValueError(f"{what} {path}: the model has no routed experts, so there is nothing to place")
    layers = {}
    for key, row in counts.items():
        layer = int(key) if key.isdigit() else -1
        if layer not in moe:
            raise ValueError(
                f"{what} {path}: layer {key!r} is not a MoE layer of the model (MoE layers: "
                f"{moe[0]}-{moe[-1]}): was the file measured on another model?"
            )
        if (
            not isinstance(row, list)
            or len(row) != args.n_routed_experts
            or any(type(n) is not int or n < 0 for n in row)
        ):
            size = len(row) if isinstance(row, list) else type(row).__name__
            raise ValueError(
                f"{what} {path}: layer {key} has {size} counts, the model has {args.n_routed_experts} routed "
                "experts (one integer >= 0 each): was the file measured on another model?"
            )
        layers[layer] = row
    missing = [i for i in moe if i < args.num_hidden_layers and i not in layers]
    if missing:
        raise ValueError(f"{what} {path}: no counts for MoE layers {missing}: {fix}")
    order = sorted(layers)
    return ExpertLoadFile(tokens, tuple(order), torch.tensor([layers[i] for i in order], dtype=torch.long))
