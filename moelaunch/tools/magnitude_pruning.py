"""Unstructured magnitude pruning of the projection weights: the smallest |w| of each matrix set to 0,
either a fraction S of it, or 2 of every 4 consecutive input weights (the 2:4 pattern sparse tensor
cores run).

Zeros alone make nothing faster here; the checkpoint is what a sparse kernel or a compressor takes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moelaunch.model.checkpoint import check_new_checkpoint_dir
from moelaunch.tools.checkpoint_writer import (
    check_finite,
    read_config,
    read_tensors,
    write_checkpoint,
)
from moelaunch.tools.convert import is_quantizable

# N:M patterns: keep N of every M consecutive weights along the input dimension.
PATTERNS = {"2:4": (2, 4)}


def check_sparsity(sparsity: float, pattern: str | None) -> None:
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity {sparsity} is not a fraction of weights to zero: choose 0 <= S < 1")
    if pattern is not None:
        if pattern not in PATTERNS:
            raise ValueError(f"pattern {pattern!r} is not supported: choose one of {', '.join(PATTERNS)}")
        keep, group = PATTERNS[pattern]
        zeroed = 1 - keep / group
        if sparsity != zeroed:
            raise ValueError(
                f"pattern {pattern} zeroes {zeroed:g} of the weights: give --sparsity {zeroed:g}"
            )


def prune_smallest(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    """weight with exactly round(sparsity * numel) of its smallest-magnitude entries set to 0."""
    flat = weight.flatten().clone()
    n_zero = round(sparsity * flat.numel())
    # Indices, not a threshold: ties at the threshold would zero more than asked.
    flat[flat.float().abs().argsort(stable=True)[:n_zero]] = 0
    return flat.view_as(weight)


def prune_n_of_m(weight: torch.Tensor, keep: int, group: int) -> torch.Tensor:
    """weight [out, in] with only the `keep` largest |w| of every `group` consecutive inputs left."""
    rows, cols = weight.shape
    if cols % group:
        raise ValueError(f"{cols} input features do not split into groups of {group}")
    groups = weight.reshape(rows, cols // group, group)
    smallest = groups.float().abs().topk(group - keep, dim=-1, largest=False).indices
    return groups.scatter(-1, smallest, 0).view(rows, cols)


def prune_weights(
    tensors: dict[str, torch.Tensor], sparsity: float, pattern: str | None
) -> dict[str, torch.Tensor]:
    """Every projection weight pruned; embeddings, the head, gates and norms unchanged."""
    out = {}
    for name, tensor in tensors.items():
        if not is_quantizable(name, tuple(tensor.shape)):
            out[name] = tensor
        elif pattern is None:
            out[name] = prune_smallest(tensor, sparsity)
        else:
            try:
                out[name] = prune_n_of_m(tensor, *PATTERNS[pattern])
            except ValueError as e:
                raise ValueError(f"{name}: {e}, so pattern {pattern} does not apply") from None
    return out


def prune_magnitude(src: str | Path, out: str | Path, sparsity: float, pattern: str | None = None) -> Path:
    """Write `out`: `src` with its projection weights pruned by magnitude (see the module doc)."""
    check_sparsity(sparsity, pattern)
    check_new_checkpoint_dir(src, out)
    config = read_config(src)
    check_finite(src)
    return write_checkpoint(src, out, prune_weights(read_tensors(src), sparsity, pattern), config)
