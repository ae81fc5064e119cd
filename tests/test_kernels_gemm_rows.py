"""bf16 GEMMs on the CPU with their rows rounded up (kernels/gemm_rows.py), so that oneDNN reuses the
kernels it compiled: the sizes repeat and waste at most 1/8, and the products equal F.linear's within
bf16's rounding, gated (SiLU epilogue) or not, whatever the rows' dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from error_bounds import assert_within, matmul_error

from moelaunch import kernels
from moelaunch.kernels.gemm_rows import linear_padded

U_BF16 = 2.0**-8  # bf16's unit roundoff: the GEMM's output is rounded to bf16 once


def test_padded_rows_come_in_eight_sizes_per_power_of_two_and_waste_at_most_an_eighth():
    sizes = [kernels.padded_rows(rows) for rows in range(1, 20_000)]
    for rows, size in enumerate(sizes, start=1):
        assert size == rows or 0 < 8 * (size - rows) < rows
        assert kernels.padded_rows(size) == size
    for power in range(4, 14):
        assert len({s for s in sizes if 2**power <= s < 2 ** (power + 1)}) == 8


@pytest.mark.parametrize("rows", [33, 100, 300, 2049])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_padded_linear_equals_the_exact_product_within_bf16(rows, x_dtype):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(x_dtype)
    w = torch.randn(48, 96, generator=g).bfloat16()
    out = linear_padded(x, w)
    assert out.shape == (rows, 48) and out.dtype == torch.bfloat16 and out.is_contiguous()
    xb = x.bfloat16().float()
    exact = F.linear(xb.double(), w.double())
    bound = matmul_error(xb, w.float().T) * 2 + U_BF16 * exact.abs()
    assert_within(out.double(), exact, bound)


@pytest.mark.parametrize("gated", [False, True])
def test_linear_of_many_rows_under_bf16_weights(gated):
    """kernels.linear past the CPU kernel's rows: fp32 rows out for a plain product, bf16 for a gated one
    (the SiLU gate over [gate; up])."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 45, 64, generator=g)  # 135 rows: padded to 136
    w = torch.randn(2 * 40, 64, generator=g).bfloat16()
    out = kernels.linear(x, w, gated=gated)
    product = F.linear(x.bfloat16().double(), w.double())
    if gated:
        gate, up = product.chunk(2, dim=-1)
        exact = F.silu(gate) * up
        assert out.shape == (3, 45, 40) and out.dtype == torch.bfloat16
        # gate and up rounded to bf16 by the GEMM, then the product rounded once more
        bound = 4 * U_BF16 * (F.silu(gate).abs() + gate.abs()) * up.abs() + 1e-6
    else:
        exact = product
        assert out.shape == (3, 45, 80) and out.dtype == torch.float32
        bound = U_BF16 * exact.abs() + 1e-6
    assert_within(out.double(), exact, bound)
