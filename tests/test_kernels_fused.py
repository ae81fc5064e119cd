"""The fused per-token CPU kernels (csrc/fused_cpu.cpp) against their torch references, on strided
inputs as the model passes them (slices of a wider projection output)."""

from __future__ import annotations

import pytest
import torch
from error_bounds import gamma

from moelaunch import kernels
from moelaunch.kernels import cpu_extension
from moelaunch.kernels import fused_reference as ref
from moelaunch.kernels.selection import LINEAR_KERNEL_MAX_ROWS, moe_gate_on_cpu

pytestmark = pytest.mark.skipif(cpu_extension.module() is None, reason="the CPU kernels did not build")
ext = cpu_extension.module()


def _tables(rows: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(rows, half) * 6.3
    return angles.cos() * 1.1, angles.sin() * 1.1  # amplitude != 1, as under YaRN


@pytest.mark.parametrize(("rows", "dim"), [(1, 8), (37, 256), (5, 13)])
def test_rms_norm(rows, dim):
    wide = torch.randn(rows, dim + 9) * 3
    x, weight = wide[:, 2 : 2 + dim], torch.randn(dim)
    out, expected = ext.rms_norm_cpu(x, weight, 1e-6), ref.rms_norm_ref(x, weight, 1e-6)
    torch.testing.assert_close(out, expected, rtol=_norm_rtol(dim), atol=0)


def _norm_rtol(dim: int) -> float:
    """Two fp32 RMSNorms differ by at most twice one's relative error: the dim-term sum of squares (no
    cancellation: gamma(dim)), then rsqrt and two products, each a few ulps."""
    return 2 * gamma(dim + 4)


@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_latent_normalizes_then_rotates_in_place(interleaved):
    rows, c, p = 19, 40, 8
    wide = torch.randn(rows, c + p + 3)
    latent, weight = wide[:, : c + p], torch.randn(c)
    cos, sin = _tables(rows, p // 2)
    expected = ref.mla_latent_ref(latent.clone(), weight, 1e-6, cos, sin, interleaved)
    out = ext.mla_latent_cpu(latent, weight, 1e-6, cos, sin, interleaved)
    assert out.data_ptr() == latent.data_ptr()
    torch.testing.assert_close(latent, expected, rtol=_norm_rtol(c), atol=1e-5)  # atol: RoPE's cancellations
    torch.testing.assert_close(wide[:, c + p :], wide[:, c + p :].clone())  # neighbours untouched


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotate_tail_rotates_only_the_last_columns_of_each_head(interleaved):
    rows, heads, nope, p = 11, 3, 6, 8
    x = torch.randn(rows, heads, nope + p)
    cos, sin = _tables(rows, p // 2)
    expected = ref.rotate_tail_ref(x.clone(), cos, sin, p, interleaved)
    ext.rotate_tail_cpu(x, cos, sin, p, interleaved)
    torch.testing.assert_close(x, expected)


def test_silu_mul_over_the_whole_range():
    gate_up = torch.randn(33, 2 * 21) * 20  # beyond +-88, where a naive e^-x overflows
    gate_up[0, :4] = torch.tensor([0.0, -200.0, 200.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ext.silu_mul_cpu(gate, up), ref.silu_mul_ref(gate, up))


def test_silu_mul_of_bf16_rows_is_the_fp32_result_rounded_once():
    """bf16 gate and up (a bf16 GEMM's output, strided halves of it): widened, gated in fp32, and the
    product rounded to bf16 once: equal to rounding the fp32 kernel's result, within one bf16 step
    where the two fp32 results round differently (they agree to ~1e-7)."""
    gate_up = (torch.randn(33, 2 * 21) * 20).bfloat16()
    gate_up[0, :4] = torch.tensor([0.0, -200.0, 200.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    out = kernels.silu_mul(gate, up)
    assert out.dtype == torch.bfloat16
    expected = ref.silu_mul_ref(gate.float(), up.float())
    # atol: silu(-200) is ~1e-36 where the kernel clamps e^-x (see simd.h), 0 in torch.
    torch.testing.assert_close(out.float(), expected.bfloat16().float(), rtol=2**-7, atol=1e-30)
    assert (out.float() == expected.bfloat16().float()).float().mean() > 0.99
    with pytest.raises(RuntimeError, match="both fp32 or both bf16"):
        ext.silu_mul_cpu(gate, up.float())


@pytest.mark.parametrize("with_base", [True, False])
def test_moe_combine(with_base):
    tokens, k, d = 13, 3, 20
    y = torch.randn(tokens * k, d)
    slot = torch.randperm(tokens * k).view(tokens, k)
    weights = torch.rand(tokens, k)
    base = torch.randn(tokens, d + 4)[:, :d] if with_base else None
    out = ext.moe_combine_cpu(y, slot, weights, base)
    torch.testing.assert_close(out, ref.moe_combine_ref(y, slot, weights, base))


def test_moe_combine_refuses_a_slot_out_of_range():
    with pytest.raises(RuntimeError, match="out of range"):
        ext.moe_combine_cpu(torch.randn(4, 8), torch.tensor([[0, 4]]), torch.ones(1, 2), None)


def test_dispatch_keeps_autograd_on_the_reference():
    x = torch.randn(4, 16, requires_grad=True)
    weight = torch.ones(16, requires_grad=True)
    kernels.rms_norm(x, weight, 1e-6).sum().backward()
    assert x.grad is not None and weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), ref.rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize(
    ("experts", "top_k", "groups", "kept", "sigmoid", "bias", "normalize"),
    [
        (64, 6, 8, 4, True, True, True),  # DeepSeek-V3: sigmoid, noaux_tc bias, group-limited
        (16, 4, 4, 2, True, False, True),  # groups ranked by their best score
        (8, 2, 1, 1, False, False, False),  # V2-style softmax, no groups, unnormalized
    ],
)
def test_moe_route(experts, top_k, groups, kept, sigmoid, bias, normalize):
    logits = torch.randn(33, experts) * 2
    b = torch.randn(experts) * 0.3 if bias else None
    args = (top_k, groups, kept, sigmoid, normalize, 2.5)
    weights, ids = ext.moe_route_cpu(logits, b, *args)
    ref_weights, ref_ids = ref.moe_route_ref(logits, b, *args)
    assert torch.equal(ids, ref_ids)  # random scores: no ties, so the same experts in the same order
    # Both sum the same fp32 terms (softmax over the experts, then the top k), each a few ulps apart.
    torch.testing.assert_close(weights, ref_weights, rtol=4 * gamma(experts + top_k + 4), atol=0)


@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 6, 64), (37, 4, 16), (300, 8, 8), (0, 2, 4)])
def test_moe_sort_rows_is_the_stable_sort_with_its_gather(tokens, top_k, experts):
    x = torch.randn(tokens, 24)
    # Ties everywhere (few experts, many pairs): the order within an expert's run must be the pairs'.
    ids = (
        torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
        if tokens
        else torch.empty(0, top_k)
    )
    ids = ids.long()
    got = ext.moe_sort_rows_cpu(x, ids, experts)
    want = ref.moe_sort_rows_ref(x, ids, experts)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    rows, _, offsets, slot = got
    assert torch.equal(rows[slot], x[:, None].expand(tokens, top_k, 24))  # each pair's row is its token's


def test_moe_sort_rows_refuses_an_expert_id_out_of_range():
    with pytest.raises(RuntimeError, match="expert id out of range"):
        ext.moe_sort_rows_cpu(torch.randn(2, 4), torch.tensor([[0, 1], [2, 4]]), 4)


def test_add_rms_norm_is_the_add_then_the_norm():
    x, y = torch.randn(37, 96)[:, :64], torch.randn(37, 64)  # x strided, as a wider output's slice
    weight = torch.rand(64) + 0.5
    total, normed = ext.add_rms_norm_cpu(x, y, weight, 1e-6)
    assert torch.equal(total, x + y)
    torch.testing.assert_close(normed, ref.rms_norm_ref(x + y, weight, 1e-6), rtol=4 * gamma(64), atol=1e-6)


def test_moe_combine_adds_the_residual_once():
    y, weights = torch.randn(12, 16), torch.rand(4, 3)
    slot = torch.randperm(12).view(4, 3)
    base, residual = torch.randn(4, 16), torch.randn(4, 16)
    out = ext.moe_combine_cpu(y, slot, weights, base, residual)
    torch.testing.assert_close(out, ref.moe_combine_ref(y, slot, weights, base, residual))
    torch.testing.assert_close(out - residual, ext.moe_combine_cpu(y, slot, weights, base), atol=1e-6, rtol=0)


@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_input_norms_are_the_q_norm_and_the_latent_step(interleaved):
    rows, q_rank, c, p = 7, 24, 40, 8
    joint = torch.randn(rows, q_rank + c + p) * 2  # the joint q_a/kv_a product, split as the model does
    fresh = joint.clone()
    q_a, latent = joint.split([q_rank, c + p], dim=-1)
    q_weight, weight = torch.randn(q_rank), torch.randn(c)
    cos, sin = _tables(rows, p // 2)
    want_q = ref.rms_norm_ref(q_a.clone(), q_weight, 1e-5)
    want_latent = ref.mla_latent_ref(latent.clone(), weight, 1e-6, cos, sin, interleaved)
    q = ext.mla_input_norms_cpu(q_a, q_weight, 1e-5, latent, weight, 1e-6, cos, sin, interleaved)
    torch.testing.assert_close(q, want_q, rtol=_norm_rtol(q_rank), atol=0)
    torch.testing.assert_close(latent, want_latent, rtol=_norm_rtol(c), atol=1e-5)  # in place, as mla_latent
    # The dispatcher takes the kernel for these strided slices.
    got_q, got_latent = kernels.mla_input_norms(
        fresh[:, :q_rank], q_weight, 1e-5, fresh[:, q_rank:], weight, 1e-6, cos, sin, interleaved
    )
    assert torch.equal(got_q, q) and torch.equal(got_latent, latent)


def test_moe_gate_is_the_router_gemm_then_the_routing():
    experts = 64
    x, weight, bias = torch.randn(9, 48), torch.randn(experts, 48) * 0.2, torch.randn(experts) * 0.3
    args = (6, 8, 4, True, True, 2.5)  # V3's: top-6 of 8 groups, 4 kept
    for w in (weight, weight.bfloat16()):
        weights, ids = ext.moe_gate_cpu(x, w, bias, *args)
        want_weights, want_ids = ref.moe_route_ref((x.double() @ w.double().T).float(), bias, *args)
        assert torch.equal(ids, want_ids)  # random scores: no near-ties
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=0)
    with torch.enable_grad():  # under autograd: the torch path, F.linear then the routing
        weights, ids = kernels.moe_gate(x, weight.clone().requires_grad_(), bias, *args)
    assert weights.requires_grad
    assert torch.equal(ids, ext.moe_gate_cpu(x, weight, bias, *args)[1])


def test_moe_gate_leaves_prompt_sized_batches_to_blas():
    weight = torch.randn(8, 16)
    assert moe_gate_on_cpu(torch.randn(LINEAR_KERNEL_MAX_ROWS, 16), weight, None)
    assert not moe_gate_on_cpu(torch.randn(LINEAR_KERNEL_MAX_ROWS + 1, 16), weight, None)
