"""bf16 dot products (vdpbf16ps, AVX512-BF16) in the grouped-linear and paged MLA decode kernels, on
every instruction-set path this CPU can dispatch (MOELAUNCH_CPU_ISA forces each lower one; below
avx512_bf16 both kernels widen bf16 to fp32), against float64 references from the same bf16 inputs.

Tolerances: a bf16 x bf16 product is exact in fp32 and every sum is fp32, so the grouped linear keeps
the fp32 bound of its K-term dot products (error_bounds.gamma). MLA decode also rounds each softmax
weight to bf16 on the bf16 path: a relative error of at most 2^-8 per weight (bf16's unit roundoff),
which moves the normalized average by at most 2^-8 * sum_t w_t |v_t - out| on top of the fp32 bound.

An AVX2-only machine (no avx512_bf16 flag) cannot run the vdpbf16ps code: there it is not compiled, the
bf16 tests run the widening path, and the dispatch test checks that avx512_bf16 is refused instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_paths import PATHS_HERE
from error_bounds import assert_within, matmul_error
from test_kernel_ops import compiled_ops
from test_kernels_mla_decode import U_BF16, _lens_and_sharing, _naive_decode, _paged_batch, weighted_spread

from moelaunch import kernels
from moelaunch.kernels import cpu_extension, grouped_linear_cpu, mla_decode_cpu, selection
from moelaunch.kernels.cpu_ops import cpu_kernel
from moelaunch.kernels.selection import CPU_ISA_PATHS

HAS_BF16_DOT = "avx512_bf16" in PATHS_HERE
HAS_AMX = "amx" in PATHS_HERE


def _bf16_dot_calls() -> int:
    return cpu_extension.require().bf16_dot_calls()


def _grouped(counts: list[int], n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g).bfloat16()
    w = torch.randn(len(counts), n, k, generator=g).bfloat16()
    return x, w, torch.tensor([0, *counts]).cumsum(0)


def _exact(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's bf16 rows times its bf16 weight in float64, and the fp32-sum bound."""
    pairs = list(zip(x.split(counts), w, strict=True))
    exact = torch.cat([F.linear(p.double(), v.double()) for p, v in pairs])
    return exact, torch.cat([matmul_error(p.float(), v.float().T) for p, v in pairs])


# (rows per group, N, K): K tails inside one 32-value step (5, 19) and after whole steps (72, 100), rows and
# weight rows below a tile, empty groups, and whole tiles of the bench model's expert shape.
GROUPED_CASES = [
    ([1], 7, 5),
    ([0, 3, 0, 5, 2], 11, 19),
    ([4, 4, 4], 130, 72),
    ([16, 9], 64, 256),
    ([2], 6, 100),
]


@pytest.mark.parametrize(("counts", "n", "k"), GROUPED_CASES)
def test_grouped_linear_bf16_rows_match_fp32_products(isa_path, counts, n, k):
    x, w, offsets = _grouped(counts, n, k, seed=n + k)
    out = cpu_kernel("grouped_linear_cpu")(x, w, offsets, False, selection.cpu_isa_path())
    assert out.dtype == torch.float32
    assert_within(out, *_exact(x, w, counts))
    # The wrapper rounds the fp32 sums to x's dtype once: within half a bf16 ulp more.
    exact, bound = _exact(x, w, counts)
    rounded = grouped_linear_cpu.grouped_linear_cpu(x, w, offsets)
    assert rounded.dtype == torch.bfloat16
    assert_within(rounded, exact, bound + U_BF16 * (exact.abs() + bound))


@pytest.mark.parametrize(
    ("counts", "n", "k"), [([1], 14, 5), ([0, 3, 0, 5, 2], 22, 40), ([4, 4, 4, 4], 130, 72)]
)
def test_gated_grouped_linear_bf16_is_silu_of_gate_times_up(isa_path, counts, n, k):
    x, w, offsets = _grouped(counts, n, k, seed=3 * n + k)
    out = cpu_kernel("grouped_linear_cpu")(x, w, offsets, True, selection.cpu_isa_path())
    exact, bound = _exact(x, w, counts)
    gate, up = exact.chunk(2, dim=-1)
    e_gate, e_up = bound.chunk(2, dim=-1)
    # |d silu(g) / dg| < 1.1 (as tests/test_kernels_grouped_linear.py), plus the epilogue's own rounding.
    slack = 1.1 * up.abs() * e_gate + F.silu(gate).abs() * e_up + 1e-6 * (F.silu(gate) * up).abs()
    assert_within(out, F.silu(gate) * up, slack)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("c_dim", "p_dim"), [(64, 16), (512, 64), (40, 8)])
def test_paged_mla_decode_bf16_matches_exact_softmax(isa_path, c_dim, p_dim, block_size):
    """Rows of 1 to 70 tokens (odd counts leave a token without a pair), shared sequences, NaN in every
    slot no row owns; c_dim 40 ends inside a 32-column chunk and width 48 inside a 32-value step."""
    g = torch.Generator().manual_seed(c_dim + p_dim + block_size)
    b = _paged_batch(g, 6, c_dim, p_dim, block_size, *_lens_and_sharing(block_size), dtype=torch.bfloat16)
    scale = (c_dim + p_dim) ** -0.5
    out = cpu_kernel("paged_mla_decode_cpu")(
        b.q_latent, b.q_pe, b.cache, b.block_table, b.seq_lens.long(), scale, None, selection.cpu_isa_path()
    )
    exact, bound = _naive_decode(b, scale)
    if isa_path in ("avx512_bf16", "amx"):
        bound = bound + U_BF16 * weighted_spread(b, scale, exact)
    assert_within(out, exact, bound)


def test_the_dispatcher_takes_bf16_dot_products_where_the_cpu_has_them(monkeypatch):
    """Unforced, bf16 operands run vdpbf16ps on an AVX512-BF16 CPU (the counter moves once per call);
    fp32 rows meeting bf16 experts or cache are rounded and take it too (a bf16 model's activations),
    fp32 rows against fp32 experts or one bf16 weight never do; MOELAUNCH_CPU_ISA=avx512 forces the
    widening path."""
    monkeypatch.delenv("MOELAUNCH_CPU_ISA", raising=False)
    selection.cpu_isa_path.cache_clear()
    x, w, offsets = _grouped([3, 2], 8, 64, seed=0)
    b = _paged_batch(torch.Generator().manual_seed(1), 4, 64, 16, 16, [5, 20], [0, 1], dtype=torch.bfloat16)

    def calls_of(run) -> int:
        before = _bf16_dot_calls()
        run()
        return _bf16_dot_calls() - before

    def decode(q_latent: torch.Tensor, q_pe: torch.Tensor) -> None:
        mla_decode_cpu.paged_mla_decode_cpu(q_latent, q_pe, b.cache, b.block_table, b.seq_lens, 0.1)

    expected = 1 if HAS_BF16_DOT else 0
    assert CPU_ISA_PATHS[cpu_extension.require().cpu_isa_best_path()] == PATHS_HERE[-1]
    assert calls_of(lambda: grouped_linear_cpu.grouped_linear_cpu(x, w, offsets)) == expected
    assert calls_of(lambda: grouped_linear_cpu.grouped_linear_cpu(x, w, offsets, gated=True)) == expected
    assert calls_of(lambda: decode(b.q_latent, b.q_pe)) == expected
    assert calls_of(lambda: grouped_linear_cpu.grouped_linear_cpu(x.float(), w, offsets)) == expected
    assert calls_of(lambda: decode(b.q_latent.float(), b.q_pe.float())) == expected
    assert calls_of(lambda: grouped_linear_cpu.grouped_linear_cpu(x.float(), w.float(), offsets)) == 0
    one = torch.tensor([0, x.shape[0]])
    assert calls_of(lambda: grouped_linear_cpu.grouped_linear_cpu(x.float(), w[:1].contiguous(), one)) == 0
    if "avx512" in PATHS_HERE:
        monkeypatch.setenv("MOELAUNCH_CPU_ISA", "avx512")
        selection.cpu_isa_path.cache_clear()
        assert calls_of(lambda: grouped_linear_cpu.grouped_linear_cpu(x, w, offsets)) == 0
        assert calls_of(lambda: decode(b.q_latent, b.q_pe)) == 0
    if not HAS_BF16_DOT:
        monkeypatch.setenv("MOELAUNCH_CPU_ISA", "avx512_bf16")
        selection.cpu_isa_path.cache_clear()
        with pytest.raises(ValueError, match="has no avx512_bf16 path"):
            selection.cpu_isa_path()
    selection.cpu_isa_path.cache_clear()


@torch.inference_mode()
def test_bf16_calls_trace_as_one_op_each_and_count_as_run():
    """torch.compile (the static decode step) sees each bf16 call as its one custom op, whose fake gives
    the fp32 sums' shape, and the compiled calls still take the bf16 dot products."""
    x, w, offsets = _grouped([2, 2], 8, 64, seed=2)  # 2 rows per group: the gated epilogue
    b = _paged_batch(torch.Generator().manual_seed(3), 4, 64, 16, 16, [5, 20], [0, 1], dtype=torch.bfloat16)

    def step(x, w, q_latent, q_pe, cache):
        mixed = kernels.grouped_linear(x, w, offsets, gated=True)
        return (
            mixed.sum()
            + kernels.paged_mla_decode(q_latent, q_pe, cache, b.block_table, b.seq_lens, 0.1).sum()
        )

    before = _bf16_dot_calls()
    out, ops = compiled_ops(step, x, w, b.q_latent, b.q_pe, b.cache)
    assert ops == {"grouped_linear_cpu", "paged_mla_decode_cpu"}
    assert _bf16_dot_calls() - before == (2 if HAS_BF16_DOT else 0)
    torch.testing.assert_close(out, step(x, w, b.q_latent, b.q_pe, b.cache), rtol=0, atol=0)
