"""The C++ integer-weight kernels (csrc/int_linear_cpu.cpp) against the torch references and float64
products, on every instruction-set path: the CPU's best and each slower fallback, forced
(MOELAUNCH_CPU_ISA). A path this CPU lacks (an AVX2-only machine has no AVX-512) cannot run here:
forcing it must be refused clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_paths import PATHS_HERE
from error_bounds import activation_codes_error, assert_within, gamma

from moelaunch import kernels
from moelaunch.kernels import cpu_extension, int_linear_cpu, selection
from moelaunch.kernels import int4_reference as int4_ref
from moelaunch.kernels import int8_reference as int8_ref
from moelaunch.kernels.selection import CPU_ISA_PATHS

# The AMX tiles' integer products (csrc/int_linear_amx.h) need AMX-INT8 beside the amx path's AMX-BF16.
HAS_AMX_INT8 = "amx" in PATHS_HERE and "amx_int8" in open("/proc/cpuinfo").read()

# (rows per group, N, K, int4 group size): tails of every loop (rows below a tile, weight rows below a
# tile, K below one vector step), empty groups (idle experts), a last int4 group shorter than the others,
# and a group size that no 32-column AVX-512 step divides (48: the kernel drops to its AVX2 step).
CASES = [
    ([1], 7, 34, 16),
    ([0, 3, 0, 5, 2], 11, 200, 16),
    ([4, 9], 64, 256, 128),
    ([33], 13, 384, 128),
    ([2, 2], 5, 96, 48),
    # 29 rows against N % 16 == 0 and K % 64 == 0: INT8 and W8A8 take the AMX tiles on the amx path (three
    # 16-row weight tiles, the last paired with itself; three 64-byte K slices, the last without a pair),
    # and INT4 its groups of 8 rows or more (also the 9 rows above: one group tiled, one not).
    ([20, 0, 9], 48, 192, 64),
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


def _assert_products_of_16bit_codes(
    out: torch.Tensor, x: torch.Tensor, counts: list[int], dense: list[torch.Tensor], k: int
) -> None:
    """The weight-only kernels multiply x's rows as 16-bit codes (x ~ code * step, step = amax / 32767):
    their result is the float64 product of the codes to fp32 rounding, so within the codes' rounding
    (plus that) of the product of x itself."""
    step = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 32767
    codes = torch.round(x / step)
    assert codes.abs().max() <= 32767
    on_codes, magnitude = _per_group(codes.double() * step.double(), counts, dense)
    assert_within(out, on_codes, gamma(k + 3) * magnitude)
    on_x, _ = _per_group(x, counts, dense)
    codes_error = torch.cat(
        [activation_codes_error(p, w.abs()) for p, w in zip(x.split(counts), dense, strict=True)]
    )
    assert_within(out, on_x, gamma(k + 3) * magnitude + codes_error)


@pytest.mark.parametrize(("counts", "n", "k", "group"), CASES)
def test_int8_kernel_matches_the_dequantized_product(counts, n, k, group, isa_path):
    x, w, offsets = _stacks(counts, n, k, seed=n + k)
    q, s = zip(*(int8_ref.int8_weight_quant_ref(wg) for wg in w), strict=True)
    out = int_linear_cpu.int8_linear_cpu(x, torch.stack(q), torch.stack(s), offsets)
    dense = [int8_ref.int8_dequant_ref(*p, torch.float64) for p in zip(q, s, strict=True)]
    assert out.shape == (sum(counts), n) and out.dtype == torch.float32
    _assert_products_of_16bit_codes(out, x, counts, dense, k)


@pytest.mark.parametrize(("counts", "n", "k", "group"), CASES)
def test_int4_kernel_matches_the_dequantized_product(counts, n, k, group, isa_path):
    """Groups of few rows: the vector kernel's 16-bit codes. Groups of 8 rows or more where the shape fits
    (N % 16, K % 32) on the amx path: the weight dequantized to bf16 and x rounded to bf16 on the bf16
    tiles, each value within bf16's rounding (2^-8 relative) of its own, the sums in fp32."""
    x, w, offsets = _stacks(counts, n, k, seed=n * k)
    packed, scale, zero = zip(*(int4_ref.int4_weight_quant_ref(wg, group) for wg in w), strict=True)
    stacks = [torch.stack(t) for t in (packed, scale, zero)]
    before = cpu_extension.require().amx_calls()
    out = int_linear_cpu.int4_linear_cpu(x, *stacks, offsets, group)
    tile_calls = cpu_extension.require().amx_calls() - before
    tiled = [isa_path == "amx" and rows >= 8 and n % 16 == 0 and k % 32 == 0 for rows in counts]
    assert tile_calls == int(any(tiled))
    parts = zip(out.split(counts), x.split(counts), packed, scale, zero, tiled, strict=True)
    for got, rows, *quantized, tiles in parts:
        if rows.shape[0] == 0:
            continue
        dense = int4_ref.int4_dequant_ref(*quantized, group, torch.float64)
        if not tiles:
            _assert_products_of_16bit_codes(got, rows, [rows.shape[0]], [dense], k)
            continue
        exact, magnitude = _per_group(rows, [rows.shape[0]], [dense])
        assert_within(got, exact, (2 * 2**-8 + 2**-16 + gamma(k + 1)) * magnitude)


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


@pytest.mark.parametrize("counts", [[3, 0, 2], [12, 0, 9]], ids=["vector", "tiles"])
@pytest.mark.parametrize("method", ["int8", "w8a8", "int4"])
def test_gated_and_bf16_results_round_the_fp32_sums_once(method, counts, isa_path):
    """gated (a [gate; up] stack) gives silu(gate) * up of the plain product; bf16 rows give the result of
    the same values in fp32 (the same codes), rounded once to bf16, gated or not; with few rows (the
    vector code) and with 21 (INT8 and W8A8 on the AMX tiles where the path has them)."""
    x, w, offsets = _stacks(counts, 32, 256, seed=7)
    if method == "int4":
        quantized = (int4_ref.int4_weight_quant_ref(wg) for wg in w)
        tensors = [torch.stack(t) for t in zip(*quantized, strict=True)]

        def call(rows, gated):
            return int_linear_cpu.int4_linear_cpu(rows, *tensors, offsets, kernels.INT4_GROUP_SIZE, gated)
    else:
        quantized = (int8_ref.int8_weight_quant_ref(wg) for wg in w)
        tensors = [torch.stack(t) for t in zip(*quantized, strict=True)]
        kernel = getattr(int_linear_cpu, f"{method}_linear_cpu")

        def call(rows, gated):
            return kernel(rows, *tensors, offsets, gated)

    gate, up = call(x, False).chunk(2, dim=-1)
    gated = call(x, True)
    assert gated.shape == (sum(counts), 16)
    torch.testing.assert_close(gated, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    rows = x.bfloat16()
    for gated in (False, True):
        out = call(rows, gated)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, call(rows.float(), gated).bfloat16())


@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_many_rows_take_the_amx_tiles_where_the_cpu_has_them(method, isa_path):
    """From 16 rows, shapes the tiles fit (K % 64, N % 16) run on the AMX-INT8 tiles on the amx path (the
    cases above check their products); fewer rows, other shapes and the other paths run the vector code.
    A CPU without AMX-INT8 runs the vector code everywhere."""
    x, w, offsets = _stacks([16], 32, 128, seed=3)
    q, s = int8_ref.int8_weight_quant_ref(w[0])
    kernel = getattr(int_linear_cpu, f"{method}_linear_cpu")

    def tile_calls(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> int:
        before = cpu_extension.require().amx_calls()
        kernel(rows, weight[None], scale[None], torch.tensor([0, rows.shape[0]]))
        return cpu_extension.require().amx_calls() - before

    tiles = isa_path == "amx" and HAS_AMX_INT8
    assert tile_calls(x, q, s) == (1 if tiles else 0)
    assert tile_calls(x[:15], q, s) == 0
    assert tile_calls(x[:, :96].contiguous(), q[:, :96].contiguous(), s) == 0  # K = 96
    assert tile_calls(x, q[:24], s[:24]) == 0  # N = 24


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
        tolerance = 0 if method == "w8a8" else 2**-12  # the weight-only kernels' 16-bit codes of x
        torch.testing.assert_close(
            got, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item()
        )
