"""Tiny random DeepSeek checkpoints written by transformers (an implementation nobody here wrote), and
edits to them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moelaunch.measure.random_checkpoint import write_random_checkpoint

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def make_hf_model(path: Path, family: str = "v3", seed: int = 0, **overrides: Any) -> Path:
    """A tiny random DeepseekV3ForCausalLM (or V2, for softmax routing) with decisive routing."""
    return write_random_checkpoint(path, "tiny", family, seed, decisive_routing=True, **overrides)


def add_byte_tokenizer(path: Path) -> Path:
    from moelaunch.text.byte_tokenizer import write_byte_tokenizer

    return write_byte_tokenizer(Path(path))


def add_mtp_layer(path: Path) -> Path:
    """Give a checkpoint an MTP layer (transformers writes none): a copy of the last decoder block with
    eh_proj passing the hidden state through. Untrained, it drafts poorly, which tests the rejections."""
    from safetensors.torch import load_file, save_file

    from moelaunch.model import load_args

    args = load_args(path)
    tensors = load_file(path / "model.safetensors")
    last, mtp = f"model.layers.{args.num_hidden_layers - 1}.", f"model.layers.{args.num_hidden_layers}."
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[mtp + name[len(last) :]] = tensors[name].clone()
    dim = args.hidden_size
    eh = torch.zeros(dim, 2 * dim)
    eh[:, dim:] = torch.eye(dim)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{norm}.weight"] = torch.ones(dim)
    tensors[mtp + "eh_proj.weight"] = eh
    save_file(tensors, path / "model.safetensors")
    return path
