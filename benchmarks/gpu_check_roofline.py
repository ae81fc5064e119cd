"""benchmarks/gpu_check.py's roofline: the bytes a decode step must read at least, from a checkpoint's
safetensors headers, and the tok/s that streaming them at the measured copy bandwidth would give."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def _tensor_sizes(path: Path) -> dict[str, int]:
    """Tensor name -> bytes, from each safetensors file's header (its data offsets); nothing is read."""
    sizes = {}
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                sizes[name] = end - start
    return sizes


def weight_bytes(path: Path) -> dict[str, Any]:
    """What a decode step reads: every tensor once, except the embedding (one row per token) and the
    routed experts (each layer's share, `routed_per_layer` bytes over `n_routed` experts)."""
    config = json.loads((path / "config.json").read_text())
    dense = embedding = routed = 0
    for name, size in _tensor_sizes(path).items():
        if "embed_tokens" in name:
            embedding += size
        elif ".mlp.experts." in name:
            routed += size
        else:
            dense += size
    moe_layers = config["num_hidden_layers"] - config.get("first_k_dense_replace", 0)
    return {
        "total": dense + embedding + routed,
        "dense": dense,
        "routed_per_layer": routed / moe_layers,
        "moe_layers": moe_layers,
        "n_routed": config["n_routed_experts"],
        "top_k": config["num_experts_per_tok"],
        "layers": config["num_hidden_layers"],
        "latent": config["kv_lora_rank"] + config["qk_rope_head_dim"],
    }


def step_bytes(w: dict[str, Any], batch: int, context: float) -> float:
    """Bytes one decode step at `batch` reads at least: the dense weights, the routed experts that
    `batch` tokens pick (expected distinct count under uniform routing), and the bf16 latent cache."""
    distinct = w["n_routed"] * (1 - (1 - w["top_k"] / w["n_routed"]) ** batch)
    experts = w["moe_layers"] * w["routed_per_layer"] / w["n_routed"] * distinct
    cache = batch * context * w["layers"] * w["latent"] * 2
    return w["dense"] + experts + cache


def roofline_tok_s(w: dict[str, Any], batch: int, context: float, bandwidth_gb_s: float) -> float:
    """Decode tok/s if every step only streamed its bytes at the measured copy bandwidth."""
    return batch * bandwidth_gb_s * 1e9 / step_bytes(w, batch, context)
