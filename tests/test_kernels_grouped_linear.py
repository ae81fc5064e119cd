"""The CPU grouped-linear kernel and its torch twin against F.linear per group, and the dispatcher's choice
of path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from error_bounds import assert_within, matmul_error
from test_kernels_mla_decode import U_BF16

from moelaunch import kernels
from moelaunch.kernels import grouped_linear_cpu
from moelaunch.kernels import grouped_linear_reference as ref
from moelaunch.kernels.cpu_ops import cpu_kernel
from moelaunch.kernels.fused_reference import silu_mul_ref
from moelaunch.kernels.selection import LINEAR_KERNEL_MAX_ROWS, bf16_dot_products

IMPLEMENTATIONS = {"cpu": grouped_linear_cpu.grouped_linear_cpu, "reference": ref.grouped_linear_ref}
# The gated form: the kernel's epilogue always, the dispatcher (epilogue or a second pass by rows per
# group), the torch twin.
GATED = {
    "epilogue": lambda x, w, o, gated=False: cpu_kernel("grouped_linear_cpu")(x, w, o, gated),
    "dispatch": grouped_linear_cpu.grouped_linear_cpu,
    "reference": ref.grouped_linear_ref,
}


def _expected(
    x: torch.Tensor, weight: torch.Tensor, counts: list[int], rows_rounded: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's rows times its weight in float64, and the bound on an fp32 computation's error, plus
    the rows' rounding to bf16 (relative 2^-8 each) where the dispatcher rounds them."""
    pairs = list(zip(x.split(counts), weight, strict=True))
    exact = torch.cat([F.linear(p.double(), w.double()) for p, w in pairs])
    bound = torch.cat([matmul_error(p, w.T) for p, w in pairs])
    if rows_rounded:
        bound = bound + U_BF16 * torch.cat([p.double().abs() @ w.double().abs().T for p, w in pairs])
    return exact, bound


def _rounds_rows(impl: str, weight: torch.Tensor) -> bool:
    """Whether the dispatcher rounds fp32 rows to bf16: against several bf16 weights, where the CPU has bf16
    dot products (the kernel itself and the torch twin never round)."""
    grouped = weight.shape[0] > 1 and weight.dtype == torch.bfloat16
    return impl in ("cpu", "dispatch") and grouped and bf16_dot_products()


@pytest.mark.parametrize(
    ("counts", "n", "k"),
    [
        ([1], 7, 5),  # every tail: rows, weight rows and K below one tile
        ([0, 3, 0, 5, 2], 11, 19),  # empty groups, row and weight-row remainders, K not a multiple of 8
        ([16, 9], 64, 256),  # whole tiles
        ([4, 4, 4, 4, 4, 4, 4, 4], 130, 72),  # weight rows split over several tasks
    ],
)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
def test_grouped_linear_matches_linear_per_group(counts, n, k, weight_dtype, impl, isa_path):
    """On every instruction-set path: fp32 rows take 16-lane FMAs from avx512 (a lone row two chains per
    product: the [16, 9] groups' last row), 8-lane ones below; bf16 weights the tiles from 3 rows on amx."""
    g = torch.Generator().manual_seed(sum(counts) + n + k)
    x = torch.randn(sum(counts), k, generator=g)
    weight = torch.randn(len(counts), n, k, generator=g).to(weight_dtype)
    offsets = torch.tensor([0, *counts]).cumsum(0)
    out = IMPLEMENTATIONS[impl](x, weight, offsets)
    assert out.shape == (sum(counts), n) and out.dtype == torch.float32
    assert_within(out, *_expected(x, weight, counts, _rounds_rows(impl, weight)))


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
def test_bad_offsets_are_refused(impl):
    x, weight = torch.randn(4, 8), torch.randn(2, 3, 8)
    with pytest.raises(RuntimeError, match="offsets must start at 0 and end at x's row count"):
        IMPLEMENTATIONS[impl](x, weight, torch.tensor([0, 1, 3]))
    with pytest.raises(RuntimeError, match="one more entry than groups"):
        IMPLEMENTATIONS[impl](x, weight, torch.tensor([0, 4]))


def _linear_calls(monkeypatch, x: torch.Tensor, weight: torch.Tensor) -> list[str]:
    calls: list[str] = []
    kernel = grouped_linear_cpu.grouped_linear_cpu
    counted_kernel = lambda *a: calls.append("kernel") or kernel(*a)  # noqa: E731
    monkeypatch.setattr(grouped_linear_cpu, "grouped_linear_cpu", counted_kernel)
    monkeypatch.setattr(F, "linear", lambda *a, _f=F.linear: calls.append("blas") or _f(*a))
    out = kernels.linear(x, weight)
    w = weight.detach()
    assert_within(out, x.double() @ w.double().T, matmul_error(x, w.T))
    return calls


def test_linear_dispatch(monkeypatch):
    weight = torch.randn(24, 16)
    monkeypatch.delenv("MOELAUNCH_CPU_KERNELS", raising=False)
    assert _linear_calls(monkeypatch, torch.randn(2, 3, 16), weight) == ["kernel"]  # 6 rows: decode-sized
    assert _linear_calls(monkeypatch, torch.randn(0, 16), weight) == ["kernel"]  # an idle DP replica's step
    assert _linear_calls(monkeypatch, torch.randn(LINEAR_KERNEL_MAX_ROWS + 1, 16), weight) == ["blas"]
    trained = weight.clone().requires_grad_()
    assert _linear_calls(monkeypatch, torch.randn(2, 16), trained) == ["blas"]  # autograd needs F.linear
    with torch.no_grad():
        assert _linear_calls(monkeypatch, torch.randn(2, 16), trained) == ["kernel"]
    monkeypatch.setenv("MOELAUNCH_CPU_KERNELS", "0")
    assert _linear_calls(monkeypatch, torch.randn(2, 16), weight) == ["blas"]


@pytest.mark.parametrize(
    ("counts", "n", "k"),
    [
        ([1], 14, 5),  # tails everywhere: 7 gate columns, K below one vector
        ([0, 3, 0, 5, 2], 22, 19),  # empty groups, row and column remainders
        ([4, 4, 4, 4], 130, 72),  # 65 gate columns: each group's columns over several tasks
    ],
)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", sorted(GATED))
def test_gated_grouped_linear_is_silu_of_gate_times_up(counts, n, k, weight_dtype, impl):
    g = torch.Generator().manual_seed(sum(counts) + n + k)
    x = torch.randn(sum(counts), k, generator=g)
    weight = torch.randn(len(counts), n, k, generator=g).to(weight_dtype)
    offsets = torch.tensor([0, *counts]).cumsum(0)
    fn = GATED[impl]
    out = fn(x, weight, offsets, gated=True)
    assert out.shape == (sum(counts), n // 2) and out.dtype == torch.float32
    # The epilogue sees the very products the plain call returns and gates them as its silu_mul does; the
    # C++ one gates a task's columns at a time, so a column may take the scalar exp where a whole row's
    # pass took the vector one (each within 2e-7 of e^x).
    silu_mul = silu_mul_ref if impl == "reference" else kernels.silu_mul
    two_passes = silu_mul(*fn(x, weight, offsets).chunk(2, dim=-1))
    torch.testing.assert_close(out, two_passes, rtol=1e-6, atol=0)
    exact, bound = _expected(x, weight, counts, _rounds_rows(impl, weight))
    gate, up = exact.chunk(2, dim=-1)
    # |d silu(g) / dg| < 1.1: a product's error moves silu(g) * u by at most 1.1 |u| e_g + |silu(g)| e_u.
    e_gate, e_up = bound.chunk(2, dim=-1)
    slack = 1.1 * up.abs() * e_gate + F.silu(gate).abs() * e_up + 1e-6 * (F.silu(gate) * up).abs()
    assert_within(out, F.silu(gate) * up, slack)


def test_gated_linear_dispatch(monkeypatch):
    weight = torch.randn(24, 16)
    for rows in (3, LINEAR_KERNEL_MAX_ROWS + 1):  # the kernel's epilogue, then F.linear and silu_mul
        x = torch.randn(rows, 16)
        out = kernels.linear(x, weight, gated=True)
        expected = F.silu(x.double() @ weight[:12].double().T) * (x.double() @ weight[12:].double().T)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_gated_linear_after_a_bf16_gemm_stays_bf16():
    """fp32 rows past the kernel's rows on a bf16 weight: a bf16 GEMM whose output goes through the SiLU
    gate in bf16 (what the down projection reads), within bf16's rounding of the exact gate."""
    weight = torch.randn(24, 16).bfloat16()
    x = torch.randn(LINEAR_KERNEL_MAX_ROWS + 1, 16)
    out = kernels.linear(x, weight, gated=True)
    assert out.dtype == torch.bfloat16
    products = x.bfloat16().double() @ weight.double().T
    expected = F.silu(products[:, :12]) * products[:, 12:]
    torch.testing.assert_close(out.double(), expected, rtol=2**-6, atol=2**-6)


def test_gated_kernel_refuses_an_odd_width():
    with pytest.raises(RuntimeError, match="N must be even"):
        x, odd = torch.randn(2, 8), torch.randn(1, 5, 8)
        grouped_linear_cpu.grouped_linear_cpu(x, odd, torch.tensor([0, 2]), gated=True)


def test_gating_leaves_the_epilogue_above_two_rows_per_group(monkeypatch):
    x, weight = torch.randn(5, 8), torch.randn(2, 6, 8)
    flags: list[bool] = []
    kernel = cpu_kernel("grouped_linear_cpu")
    monkeypatch.setattr(
        grouped_linear_cpu, "cpu_kernel", lambda name: lambda *a: flags.append(a[3]) or kernel(*a)
    )
    for rows in (4, 5):  # 2 rows per group: the epilogue; 2.5: the product, then silu_mul
        out = grouped_linear_cpu.grouped_linear_cpu(x[:rows], weight, torch.tensor([0, 2, rows]), gated=True)
        assert out.shape == (rows, 3)
    assert flags == [True, False]
