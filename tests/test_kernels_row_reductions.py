"""The sampler's row reductions (csrc/rows_cpu.cpp): each row's greedy token and whether it is finite,
against torch's argmax and isfinite on the cases that decide them: ties (the first maximum wins), NaN
(its first index, as torch), inf and -inf, rows of one value, widths that end inside a vector, and rows
that are slices of a wider tensor."""

from __future__ import annotations

import pytest
import torch

from moelaunch import kernels
from moelaunch.kernels.cpu_ops import cpu_kernel


def _special_rows(width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(10, width, generator=g)
    x[1, [2, width - 1]] = 9.0  # a tie: the first wins
    x[2, width // 2] = float("nan")
    x[3, width - 1] = float("inf")
    x[4, 0] = float("-inf")  # non-finite too
    x[5] = float("-inf")  # argmax of all -inf: index 0
    x[6] = 3.0  # one value
    x[7, [1, width - 1]] = float("nan")  # the first NaN
    x[8, width - 1] = 50.0  # the maximum in the tail past whole vectors
    x[9, 0] = float("inf")
    x[9, 1] = float("nan")  # NaN wins over inf in torch.argmax
    return x


@pytest.mark.parametrize("width", [1, 7, 8, 37, 4096])
def test_row_argmax_and_finite_match_torch(width):
    x = _special_rows(max(width, 3))[:, :width]  # width 1 keeps only column 0
    index, finite = cpu_kernel("argmax_rows_cpu")(x.contiguous())
    assert torch.equal(index, x.argmax(-1))
    assert torch.equal(finite, torch.isfinite(x).all(dim=-1))


def test_strided_rows_and_the_dispatch():
    wide = _special_rows(40)
    x = wide[:, 3:37]  # rows a stride of 40 apart
    assert torch.equal(kernels.row_argmax(x), x.argmax(-1))
    assert torch.equal(kernels.rows_finite(x), torch.isfinite(x).all(dim=-1))
    # Not the kernel's: a column stride, or bf16 rows (torch's reductions).
    assert torch.equal(kernels.row_argmax(wide.T.contiguous().T), wide.argmax(-1))
    assert torch.equal(kernels.rows_finite(wide.bfloat16()), torch.isfinite(wide).all(dim=-1))


def test_a_greedy_step_reads_its_logits_once(monkeypatch):
    """Uncontrolled greedy rows take their tokens and the finite check from one kernel call; a NaN row
    still gets NON_FINITE_TOKEN, as through the two separate reductions."""
    from moelaunch.engine import sampler
    from moelaunch.engine.outputs import NON_FINITE_TOKEN
    from moelaunch.kernels import cpu_ops

    x = _special_rows(64)
    calls = []
    kernel = cpu_ops.cpu_kernel
    monkeypatch.setattr(
        "moelaunch.kernels.row_reductions.cpu_kernel", lambda name: calls.append(name) or kernel(name)
    )
    tokens = sampler.device_tokens(x, x, None, sampled=False)  # greedy: no draw settings read
    assert calls == ["argmax_rows_cpu"]
    expected = torch.where(torch.isfinite(x).all(dim=-1), x.argmax(-1), NON_FINITE_TOKEN)
    assert torch.equal(tokens, expected)


def test_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_kernel("argmax_rows_cpu")(torch.zeros(2, 3, dtype=torch.float64))
