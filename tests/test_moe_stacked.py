"""Stacked experts against one GEMM per expert: through the CPU grouped-linear kernel (groups of few rows)
and through zero-padded batched GEMMs (the path without the kernel, e.g. MOELAUNCH_CPU_KERNELS=0)."""

from __future__ import annotations

import pytest
import torch
from cpu_paths import PATHS_HERE
from error_bounds import gamma

from moelaunch import kernels
from moelaunch.measure.random_checkpoint import SHAPES
from moelaunch.model.config import args_from_hf_config
from moelaunch.model.moe import STACKED_MAX_ROWS, MoE


def _random_moe(seed: int) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(args_from_hf_config({**SHAPES["tiny"], "n_group": 1, "topk_group": 1}))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return moe.eval().requires_grad_(False)


@pytest.fixture(params=["kernel", "no-kernel"])
def cpu_kernels(request, monkeypatch) -> bool:
    if request.param == "no-kernel":
        monkeypatch.setenv("MOELAUNCH_CPU_KERNELS", "0")
    else:
        monkeypatch.delenv("MOELAUNCH_CPU_KERNELS", raising=False)
    return request.param == "kernel"


@pytest.mark.parametrize("tokens", [1, 8, 64, 4 * STACKED_MAX_ROWS])
def test_stacked_experts_match_expert_by_expert(tokens, cpu_kernels):
    moe = _random_moe(seed=tokens)
    x = torch.randn(tokens, moe.gate.weight.shape[1])
    expected = moe(x)
    weights_before = {n: p.clone() for n, p in moe.named_parameters()}
    moe.stack_experts()
    assert moe.gate_up is not None and moe.down is not None
    # The experts' own weights are now views of the stacks, with unchanged values.
    assert moe.experts["3"].down_proj.weight.data_ptr() == moe.down.weight[3].data_ptr()
    for name, p in moe.named_parameters():
        assert torch.equal(p, weights_before[name]), name
    # The paths sum the same fp32 products in other orders: each differs from the exact value by at most
    # gamma(K) times its terms' magnitudes, over the expert's two GEMMs (K = hidden, then intermediate).
    # With these weights the terms' magnitudes stay within a few times the largest output.
    reduction = moe.gate.weight.shape[1] + moe.experts["0"].down_proj.weight.shape[1]
    tolerance = 16 * gamma(reduction) * expected.abs().max().item()
    torch.testing.assert_close(moe(x), expected, rtol=0, atol=tolerance)


def test_paths_taken_by_group_size(monkeypatch, cpu_kernels):
    moe = _random_moe(seed=0)
    moe.stack_experts()
    calls = []
    for name in ("run_grouped_kernel", "run_stacked"):
        original = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _n=name, _f=original: calls.append(_n) or _f(*a))
    dim = moe.gate.weight.shape[1]
    moe(torch.randn(16, dim))  # 32 rows over 8 experts
    moe(torch.randn(1, dim))  # 2 of 8 experts busy
    moe(torch.randn(4 * STACKED_MAX_ROWS, dim))  # groups larger than STACKED_MAX_ROWS: expert by expert
    if cpu_kernels:  # no padding, so any number of busy experts
        assert calls == ["run_grouped_kernel", "run_grouped_kernel"]
    else:  # the padded batch only when most experts are busy
        assert calls == ["run_stacked"]


def _fp8_experts(moe: MoE) -> None:
    """Every routed expert's projections block-FP8, as a checkpoint kept in FP8 holds them."""
    for mlp in moe.experts.values():
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            q, s = kernels.weight_quant(lin.weight)
            lin.weight = torch.nn.Parameter(q, requires_grad=False)
            lin.weight_scale_inv = s


@pytest.mark.parametrize("tokens", [1, 8, 4 * STACKED_MAX_ROWS])
def test_fp8_experts_stack_and_the_grouped_kernel_matches_expert_by_expert(tokens, monkeypatch):
    """Block-FP8 experts stack with their scales; the device route (the static step's) runs them through
    the grouped MoE kernel's reference, and with MOELAUNCH_TRITON_ON_CPU=1 through the interpreted Triton
    kernel on every batch, against each expert's own W8A8 Linear (the eager CPU path)."""
    moe = _random_moe(seed=tokens + 2)
    _fp8_experts(moe)
    x = torch.randn(tokens, moe.gate.weight.shape[1])
    expected = moe(x)
    moe.stack_experts()
    assert moe.gate_up is not None and moe.gate_up.block_scale is not None and moe.routes_on_device
    assert moe.experts["2"].up_proj.weight_scale_inv.data_ptr() == moe.gate_up.block_scale[2, 1:].data_ptr()
    kernel_calls = []
    original = moe.run_moe_kernel
    moe.run_moe_kernel = lambda *a: kernel_calls.append(1) or original(*a)
    # Activations are quantized per row either way: the same products, summed in another order.
    tolerance = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(moe(x), expected, rtol=0, atol=tolerance)
    assert not kernel_calls  # eager on the CPU: expert by expert
    torch.testing.assert_close(moe(x, static=True), expected, rtol=0, atol=tolerance)
    assert kernel_calls == [1]
    monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    torch.testing.assert_close(moe(x), expected, rtol=0, atol=tolerance)
    assert kernel_calls == [1, 1]


def test_bf16_experts_through_the_triton_kernel(monkeypatch):
    """Where Triton runs, every batch takes the grouped MoE kernel with counts kept on the device."""
    moe = _random_moe(seed=5).to(torch.bfloat16)
    x = torch.randn(24, moe.gate.weight.shape[1], dtype=torch.bfloat16)
    monkeypatch.setenv("MOELAUNCH_CPU_KERNELS", "0")  # expert by expert, in bf16
    expected = moe(x)
    moe.stack_experts()
    monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    kernel_calls = []
    original = moe.run_moe_kernel
    moe.run_moe_kernel = lambda *a: kernel_calls.append(1) or original(*a)
    got = moe(x)
    assert kernel_calls == [1]
    # bf16 outputs of each projection, rounded at other points: a few bf16 steps of the largest output.
    torch.testing.assert_close(got, expected, rtol=0, atol=4 * 2**-8 * expected.abs().max().item())
    # The expert-parallel path hands over host counts (rows already exchanged): the same kernel.
    counts = [3, 0, 5, 1, 0, 0, 7, 2]
    x_sorted = torch.randn(sum(counts), x.shape[1], dtype=torch.bfloat16)
    bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
    one_by_one = torch.cat([moe.experts[str(e)](x_sorted[bounds[e] : bounds[e + 1]]) for e in range(8)])
    torch.testing.assert_close(
        moe.run_grouped(x_sorted, counts), one_by_one, rtol=0, atol=4 * 2**-8 * one_by_one.abs().max().item()
    )
    assert kernel_calls == [1, 1]


@pytest.mark.parametrize("method", ["int8", "w8a8", "int4"])
@pytest.mark.parametrize("tokens", [1, 8, 4 * STACKED_MAX_ROWS])
def test_integer_experts_stack_and_match_expert_by_expert(method, tokens, cpu_kernels):
    """Integer experts stack too (their scales and zero points alike) and run through the grouped integer
    kernels for any number of rows; without the kernels, expert by expert through the references."""
    from moelaunch.model.quantization import IntQuant, quantize_weight

    moe = _random_moe(seed=tokens + len(method))
    quant = IntQuant(method, group_size=16)  # the tiny experts' K = 64: four int4 groups
    for mlp in moe.experts.values():
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.set_quantized(quantize_weight(lin.weight, quant), quant)
    x = torch.randn(tokens, moe.gate.weight.shape[1])
    expected = moe(x)
    moe.stack_experts()
    assert moe.gate_up is not None and moe.gate_up.quant == quant
    assert (
        moe.experts["2"].up_proj.weight_scale.data_ptr()
        == moe.gate_up.scale[2, moe.gate_up.weight.shape[1] // 2 :].data_ptr()
    )
    calls = []
    original = moe.run_grouped_kernel
    moe.run_grouped_kernel = lambda *a: calls.append(1) or original(*a)
    got = moe(x)
    assert bool(calls) == cpu_kernels
    # Weight-only: the kernels' 16-bit codes of the expert inputs, which the two paths sum in different
    # orders, may round a value to the neighbouring code. INT4 with many rows per expert on an AMX CPU:
    # the stacked call's experts run on the bf16 tiles, some of the one-by-one calls (fewer rows) not
    # (measured 2.4e-3 of the largest output).
    if method == "int4" and tokens > STACKED_MAX_ROWS and "amx" in PATHS_HERE:
        torch.testing.assert_close(got, expected, rtol=0, atol=2**-7 * expected.abs().max().item())
        return
    torch.testing.assert_close(got, expected, rtol=0 if method == "w8a8" else 2**-12, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 8, 4 * STACKED_MAX_ROWS])
def test_routing_on_the_device_matches_host_counts(tokens, cpu_kernels):
    """The static step's MoE path (offsets found on the device, no counts read back) against the path
    that reads counts back, with and without the grouped kernel (without it, every expert is padded to
    the token count)."""
    moe = _random_moe(seed=tokens + 1)
    moe.stack_experts()
    x = torch.randn(tokens, moe.gate.weight.shape[1])
    expected = moe(x)
    reduction = moe.gate.weight.shape[1] + moe.experts["0"].down_proj.weight.shape[1]
    tolerance = 16 * gamma(reduction) * expected.abs().max().item()
    torch.testing.assert_close(moe(x, static=True), expected, rtol=0, atol=tolerance)


def test_bf16_experts_of_a_prompt_step_gather_bf16_rows_with_the_same_result(monkeypatch):
    """An expert with more routed rows than the grouped kernel takes (a prompt step): the rows are rounded
    to the experts' bf16 before the gather (the per-expert bf16 GEMMs round them anyway), with bitwise the
    result of gathering fp32 rows; fewer rows keep fp32 rows (the grouped kernel returns fp32 sums)."""
    moe = _random_moe(seed=3)
    moe.to(torch.bfloat16)
    moe.gate.to(torch.float32)
    moe.stack_experts()
    dim, experts = moe.gate.weight.shape[1], moe.n_routed_experts
    x = torch.randn(moe._grouped_kernel_rows() * experts // moe.gate.top_k + 1, dim)
    gathered = []
    dispatch = type(moe.dispatch).__call__
    monkeypatch.setattr(
        type(moe.dispatch),
        "__call__",
        lambda self, rows, *a: gathered.append(rows.dtype) or dispatch(self, rows, *a),
    )
    out = moe(x)
    assert gathered == [torch.bfloat16] and out.dtype == torch.float32
    monkeypatch.setattr(MoE, "_gathers_in_bf16", lambda *a: False)
    assert torch.equal(out, moe(x))
    assert gathered[-1] == torch.float32
    monkeypatch.undo()
    gathered.clear()
    moe(torch.randn(8, dim))
    assert gathered in ([], [torch.float32])  # few rows: routed on the device, or fp32 rows gathered
