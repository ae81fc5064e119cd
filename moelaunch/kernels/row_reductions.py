"""Each row's greedy token and whether the row is finite, for the sampler: csrc/rows_cpu.cpp on fp32
CPU rows (one pass gives both), torch elsewhere."""

from __future__ import annotations

import torch
from torch import Tensor

from moelaunch.kernels import selection
from moelaunch.kernels.cpu_ops import cpu_kernel


def row_argmax(x: Tensor) -> Tensor:
    """[R] long: the first index of each row's maximum (of its first NaN, if any), as x.argmax(-1)."""
    if selection.row_reductions_on_cpu(x):
        return cpu_kernel("argmax_rows_cpu")(x)[0]
    return x.argmax(-1)


def rows_finite(x: Tensor) -> Tensor:
    """[R] bool: whether each row holds neither NaN nor inf."""
    if selection.row_reductions_on_cpu(x):
        return cpu_kernel("argmax_rows_cpu")(x)[1]
    return torch.isfinite(x).all(dim=-1)


def row_argmax_and_finite(x: Tensor) -> tuple[Tensor, Tensor]:
    """(`row_argmax(x)`, `rows_finite(x)`) from one pass over x where the kernel takes it (a greedy step's
    logits are read once, not twice)."""
    if selection.row_reductions_on_cpu(x):
        index, finite = cpu_kernel("argmax_rows_cpu")(x)
        return index, finite
    return x.argmax(-1), torch.isfinite(x).all(dim=-1)
