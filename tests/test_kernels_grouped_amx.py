"""The grouped-linear kernel through the AMX tiles (csrc/grouped_linear_amx.h) against float64 products of
the same bf16 inputs, with the bound of the vdpbf16ps path it shares its numerics with (fp32 sums of bf16
products: tests/test_kernels_bf16_dot.py), and the dispatch that sends calls to it.

The cases walk what the tile code does differently: groups of 1 to 40 rows (one chunk of 16 x rows, a
partial second, three), empty groups, output widths of 16 (one weight tile, paired with itself), 48 (an
odd count of tiles) and 160 (several tasks per group), K of 32 (one slice), 96 (an odd count of slices)
and 512; gated weights, whose gate and up tiles are multiplied as a pair.

Each test runs on every instruction-set path this CPU has (the `isa_path` fixture): below amx the same
calls take the vdpbf16ps or widening path, and the tests check that they did and still give the product.
A CPU without AMX tiles (no amx_bf16 flag, or Linux refusing the tile state) cannot run the tile code.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from error_bounds import assert_within
from test_kernels_bf16_dot import _exact, _grouped
from test_kernels_mla_decode import U_BF16

from moelaunch import kernels
from moelaunch.kernels import cpu_extension, grouped_linear_cpu, selection
from moelaunch.kernels.cpu_ops import cpu_kernel
from moelaunch.kernels.selection import CPU_ISA_PATHS


def _amx_calls() -> int:
    return cpu_extension.require().amx_calls()


def _on(path: str) -> bool:
    """Whether the forced path is `path` or above it."""
    return selection.cpu_isa_path() >= CPU_ISA_PATHS.index(path)


CASES = [
    ([1], 16, 32),
    ([0, 17, 0, 3], 48, 96),
    ([40, 16, 5], 160, 512),
    ([8] * 6, 64, 256),
]


@pytest.mark.parametrize(("counts", "n", "k"), CASES)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("rows_dtype", [torch.bfloat16, torch.float32], ids=["bf16-rows", "fp32-rows"])
def test_grouped_linear_matches_exact_products(isa_path, counts, n, k, gated, rows_dtype):
    """fp32 rows are rounded to bf16 as the tiles pack them, as torch rounds them (to nearest even): the
    reference takes the rows torch rounded; the other paths take fp32 rows as they are."""
    x, w, offsets = _grouped(counts, 2 * n if gated else n, k, seed=n + k + len(counts))
    rows = x
    if rows_dtype == torch.float32:
        rows = x.float() + torch.rand(x.shape, generator=torch.Generator().manual_seed(k)) * x.float() / 64
        x = rows.bfloat16() if isa_path == "amx" else rows
    before = _amx_calls()
    out = cpu_kernel("grouped_linear_cpu")(rows, w, offsets, gated, selection.cpu_isa_path())
    assert _amx_calls() - before == (1 if isa_path == "amx" else 0)
    exact, bound = _exact(x, w, counts)
    if not gated:
        assert_within(out, exact, bound)
        return
    gate, up = exact.chunk(2, dim=-1)
    e_gate, e_up = bound.chunk(2, dim=-1)
    # |d silu(g) / dg| < 1.1 (as tests/test_kernels_grouped_linear.py), plus the epilogue's own rounding.
    slack = 1.1 * up.abs() * e_gate + F.silu(gate).abs() * e_up + 1e-6 * (F.silu(gate) * up).abs()
    assert_within(out, F.silu(gate) * up, slack)


def test_the_wrapper_sends_enough_rows_of_whole_tiles_to_amx(isa_path):
    """On the amx path from AMX_MIN_ROWS_PER_GROUP rows per group (fp32 rows rounded to bf16 on the way,
    as for oneDNN's bf16 GEMM); fewer rows and widths or K not in whole tiles keep the tiles idle, as
    does every lower path. Gated calls still give silu(gate) * up."""
    per_group = grouped_linear_cpu.AMX_MIN_ROWS_PER_GROUP
    x, w, offsets = _grouped([per_group] * 4, 64, 64, seed=5)
    few, _, few_offsets = _grouped([per_group - 1] * 4, 64, 64, seed=6)

    def calls(run) -> int:
        before = _amx_calls()
        run()
        return _amx_calls() - before

    expected = 1 if isa_path == "amx" else 0
    assert calls(lambda: grouped_linear_cpu.grouped_linear_cpu(x, w, offsets)) == expected
    assert calls(lambda: grouped_linear_cpu.grouped_linear_cpu(x.float(), w, offsets)) == expected
    assert calls(lambda: grouped_linear_cpu.grouped_linear_cpu(few, w, few_offsets)) == 0
    assert calls(lambda: grouped_linear_cpu.grouped_linear_cpu(x, w[:, :24].contiguous(), offsets)) == 0
    narrow_k = x[:, :40].contiguous(), w[..., :40].contiguous()
    assert calls(lambda: grouped_linear_cpu.grouped_linear_cpu(*narrow_k, offsets)) == 0
    gate, up = _exact(x, w, [per_group] * 4)[0].chunk(2, dim=-1)
    gated = grouped_linear_cpu.grouped_linear_cpu(x.float(), w, offsets, gated=True)
    # Within bf16's rounding of the rows' products and of the result.
    torch.testing.assert_close(gated.double(), F.silu(gate) * up, atol=1e-4, rtol=4 * U_BF16)


def test_linear_takes_the_tiles_up_to_their_row_limit(isa_path):
    """One bf16 weight: up to AMX_LINEAR_MAX_ROWS rows go to the tiles on the amx path (oneDNN repacks the
    weight on every call), within bf16 rounding of oneDNN's own bf16 GEMM; past it, and on the other paths
    past LINEAR_KERNEL_MAX_ROWS, oneDNN."""
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(96, 128, generator=g).bfloat16()
    on_amx = isa_path == "amx"
    limit = selection.AMX_LINEAR_MAX_ROWS if on_amx else selection.LINEAR_KERNEL_MAX_ROWS
    assert selection.uses_grouped_linear_kernel(torch.zeros(1, 128), limit, weight)
    assert not selection.uses_grouped_linear_kernel(torch.zeros(1, 128), limit + 1, weight)
    assert not selection.uses_grouped_linear_kernel(torch.zeros(1, 128), 33, weight.float())
    for rows in (48, selection.AMX_LINEAR_MAX_ROWS):
        x = torch.randn(rows, 128, generator=g)
        before = _amx_calls()
        out = kernels.linear(x, weight)
        assert _amx_calls() - before == (1 if on_amx else 0)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, F.linear(x.bfloat16(), weight).float(), atol=2e-2, rtol=2 * U_BF16)


@pytest.mark.parametrize(("rows", "heads", "n", "k"), [(3, 2, 32, 64), (20, 8, 48, 96), (64, 4, 16, 512)])
def test_per_head_linear_reads_strided_heads_in_place(isa_path, rows, heads, n, k):
    """x [R, H, K] as a slice of wider rows (q_nope out of q), per head against its stack: the tiles read it
    in place on the amx path; every path gives the product of each head's rows (rounded to bf16 where the
    CPU multiplies bf16 pairs), as float64 gives it."""
    g = torch.Generator().manual_seed(rows + heads)
    wide = torch.randn(rows, heads, k + 16, generator=g)
    x = wide[..., :k]
    stack = torch.randn(heads, n, k, generator=g).bfloat16()

    def exact_and_bound(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        product = torch.einsum("rhk,hnk->rhn", rows.double(), stack.double())
        return product, torch.einsum("rhk,hnk->rhn", rows.double().abs(), stack.double().abs()) * k * 2.0**-23

    exact, bound = exact_and_bound(x.bfloat16() if _on("avx512_bf16") else x)
    before = _amx_calls()
    out = kernels.per_head_linear(x, stack)
    assert _amx_calls() - before == (1 if isa_path == "amx" else 0)
    assert grouped_linear_cpu.per_head_tiles_take(x, stack) == (isa_path == "amx")
    assert out.shape == (rows, heads, n) and out.dtype == torch.float32
    assert_within(out, exact, bound)
    bf16_out = kernels.per_head_linear(x.bfloat16(), stack)
    assert bf16_out.dtype == torch.bfloat16
    exact, bound = exact_and_bound(x.bfloat16())
    assert_within(bf16_out, exact, bound + U_BF16 * exact.abs())
    assert not grouped_linear_cpu.per_head_tiles_take(
        x[: grouped_linear_cpu.AMX_MIN_ROWS_PER_GROUP - 1], stack
    )
