"""The C++ integer-weight kernels (csrc/int_linear_cpu.cpp) against the torch references, on every
instruction-set path: the CPU's best and each slower fallback, forced (MOELAUNCH_CPU_ISA). A path this
CPU lacks (an AVX2-only machine has no AVX-512) cannot run here: forcing it must be refused clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_paths import PATHS_HERE
from error_bounds import assert_within, gamma

from moelaunch import kernels
from moelaunch.kernels import cpu_extension, int_linear_cpu, selection
from moelaunch.kernels import int4_reference as int4_ref
from moelaunch.kernels import int8_reference as int8_ref
from moelaunch.kernels.selection import CPU_ISA_PATHS

# (rows per group, N, K, int4 group size): tails of every loop (rows below a tile, weight rows below a
# tile, K below one vector step), empty groups (idle experts), a last int4 group shorter than the others,
# and a group size that no 32-column AVX-512 step divides (48: the kernel drops to its AVX2 step).
CASES = [
    ([1], 7, 34, 16),
    ([0, 3, 0, 5, 2], 11, 200, 16),
    ([4, 9], 64, 256, 128),
    ([33], 13, 384, 128),
    ([2, 2], 5, 96, 48),
]


def test_the_best_path_is_the_cpus_and_paths_it_lacks_are_refused(monkeypatch):
    """What cannot run here (AVX-512 on an AVX2-only CPU) is refused with the reason, not run."""
    assert CPU_ISA_PATHS[cpu_extension.require().cpu_isa_best_path()] == PATHS_HERE[-1]
    for missing in CPU_ISA_PATHS[len(PATHS_HERE) :]:
        monkeypatch.setenv("MOELAUNCH_CPU_ISA", missing)
        selection.cpu_isa_path.cache_clear()
        with pytest.raises(ValueError, match=f"this CPU \\(or compiler\\) has no {missing} path"):
            selection.cpu_isa_path()
    selection.cpu_isa_path.cache_clear()


def _stacks(counts: list[int], n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g)
    w = torch.randn(len(counts), n, k, generator=g)
    return x, w, torch.tensor([0, *counts]).cumsum(0)


def _per_group(
    x: torch.Tensor, counts: list[int], weights: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """x's groups times their dense weights in float64, and |x| @ |W| (for error bounds)."""
    parts = list(zip(x.split(counts), weights, strict=True))
    exact = torch.cat([F.linear(p.double(), w.double()) for p, w in parts])
    magnitude = torch.cat([F.linear(p.double().abs(), w.double().abs()) for p, w in parts])
    return exact, magnitude


@pytest.mark.parametrize(("counts", "n", "k", "group"), CASES)
def test_int8_kernel_matches_the_dequantized_product(counts, n, k, group, isa_path):
    x, w, offsets = _stacks(counts, n, k, seed=n + k)
    q, s = zip(*(int8_ref.int8_weight_quant_ref(wg) for wg in w), strict=True)
    out = int_linear_cpu.int8_linear_cpu(x, torch.stack(q), torch.stack(s), offsets)
    exact, magnitude = _per_group(
        x, counts, [int8_ref.int8_dequant_ref(*p, torch.float64) for p in zip(q, s, strict=True)]
    )
    assert out.shape == (sum(counts), n) and out.dtype == torch.float32
    assert_within(out, exact, gamma(k + 1) * magnitude)


@pytest.mark.parametrize(("counts", "n", "k", "group"), CASES)
def test_int4_kernel_matches_the_dequantized_product(counts, n, k, group, isa_path):
    x, w, offsets = _stacks(counts, n, k, seed=n * k)
    packed, scale, zero = zip(*(int4_ref.int4_weight_quant_ref(wg, group) for wg in w), strict=True)
    stacks = [torch.stack(t) for t in (packed, scale, zero)]
    out = int_linear_cpu.int4_linear_cpu(x, *stacks, offsets, group)
    dense = [
        int4_ref.int4_dequant_ref(*p, group, torch.float64) for p in zip(packed, scale, zero, strict=True)
    ]
    exact, magnitude = _per_group(x, counts, dense)
    # The kernel dequantizes as code * scale - zero * scale (one more rounding per weight than the reference).
    assert_within(out, exact, gamma(k + 3) * magnitude)


@pytest.mark.parametrize(("counts", "n", "k", "group"), CASES)
def test_w8a8_kernel_equals_the_reference_bit_for_bit(counts, n, k, group, isa_path):
    """Same activation codes (same fp32 rounding), exact int32 dot products, same scaling order."""
    x, w, offsets = _stacks(counts, n, k, seed=n - k)
    q, s = zip(*(int8_ref.int8_weight_quant_ref(wg) for wg in w), strict=True)
    out = int_linear_cpu.w8a8_linear_cpu(x, torch.stack(q), torch.stack(s), offsets)
    expected = torch.cat(
        [int8_ref.w8a8_linear_ref(p, *qs) for p, *qs in zip(x.split(counts), q, s, strict=True)]
    )
    assert torch.equal(out, expected)


def test_w8a8_with_a_given_row_amax_quantizes_with_it(isa_path):
    """A tensor-parallel slice quantized with its whole row's amax: the kernel and the reference agree to
    the bit, and the codes are the whole row's (not the slice's own)."""
    whole = torch.randn(5, 64)
    whole[:, 40] *= 8  # the row's amax lies outside the first half
    x, amax = whole[:, :32].contiguous(), whole.abs().amax(-1)
    q, s = int8_ref.int8_weight_quant_ref(torch.randn(24, 32))
    offsets = torch.tensor([0, 5])
    out = int_linear_cpu.w8a8_linear_cpu(x, q[None], s[None], offsets, row_amax=amax)
    assert torch.equal(out, int8_ref.w8a8_linear_ref(x, q, s, amax))
    assert not torch.equal(out, int8_ref.w8a8_linear_ref(x, q, s))


def test_bf16_rows_are_computed_in_fp32_and_returned_in_bf16(isa_path):
    x, w, offsets = _stacks([3], 16, 256, seed=5)
    q, s = int8_ref.int8_weight_quant_ref(w[0])
    out = int_linear_cpu.int8_linear_cpu(x.bfloat16(), q[None], s[None], offsets)
    assert out.dtype == torch.bfloat16
    expected = int8_ref.int8_linear_ref(x.bfloat16().float(), q, s)
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=0)


def test_an_unknown_path_is_refused(monkeypatch):
    monkeypatch.setenv("MOELAUNCH_CPU_ISA", "sse9")
    selection.cpu_isa_path.cache_clear()
    with pytest.raises(ValueError, match="MOELAUNCH_CPU_ISA='sse9' must be one of scalar, avx2, avx512"):
        selection.cpu_isa_path()
    selection.cpu_isa_path.cache_clear()


@pytest.mark.parametrize("method", ["int8", "w8a8", "int4"])
def test_entry_points_take_the_kernel_for_cpu_rows_and_the_reference_without_it(method, monkeypatch):
    """kernels.int8_linear & co. (what a quantized projection calls), plain and grouped, against the
    reference: the kernel runs for CPU rows outside autograd, the reference when the kernels are off."""
    x, w, offsets = _stacks([2, 0, 3], 24, 256, seed=1)
    if method == "int4":
        tensors = [
            torch.stack(t) for t in zip(*(int4_ref.int4_weight_quant_ref(wg) for wg in w), strict=True)
        ]
        plain, grouped = kernels.int4_linear, kernels.int4_grouped_linear
        extra = (kernels.INT4_GROUP_SIZE,)
        kernel_name = "int4_linear_cpu"
    else:
        tensors = [
            torch.stack(t) for t in zip(*(int8_ref.int8_weight_quant_ref(wg) for wg in w), strict=True)
        ]
        plain = kernels.w8a8_linear if method == "w8a8" else kernels.int8_linear
        grouped = kernels.w8a8_grouped_linear if method == "w8a8" else kernels.int8_grouped_linear
        extra = ()
        kernel_name = f"{method}_linear_cpu"
    calls = []
    kernel = getattr(int_linear_cpu, kernel_name)
    monkeypatch.setattr(int_linear_cpu, kernel_name, lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    with_kernel = (
        plain(x[None, :2], *(t[0] for t in tensors), *extra),
        grouped(x, *tensors, offsets, *extra),
    )
    assert len(calls) == 2
    monkeypatch.setenv("MOELAUNCH_CPU_KERNELS", "0")
    without = (plain(x[None, :2], *(t[0] for t in tensors), *extra), grouped(x, *tensors, offsets, *extra))
    assert len(calls) == 2
    for got, expected in zip(with_kernel, without, strict=True):
        assert got.shape == expected.shape
        tolerance = 0 if method == "w8a8" else 1e-5
        torch.testing.assert_close(
            got, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item()
        )
