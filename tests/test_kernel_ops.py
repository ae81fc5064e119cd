"""The kernels as torch custom ops: torch.compile(fullgraph=True) traces each call as one op of the
graph (the C++ CPU kernels; the Triton ones under the interpreter), with the eager result."""

from __future__ import annotations

import os

import pytest
import torch
from torch import Tensor

from moelaunch import kernels


def compiled_ops(fn, *args) -> tuple[object, set[str]]:
    """fn compiled with fullgraph=True (any graph break raises): its result and the moelaunch ops in its
    graph."""
    seen: set[str] = set()

    def backend(gm: torch.fx.GraphModule, example_inputs):
        names = (str(n.target).removesuffix(".default") for n in gm.graph.nodes)
        seen.update(n.removeprefix("moelaunch.") for n in names if n.startswith("moelaunch."))
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args), seen


def decode_layer_pieces(x: Tensor, w: Tensor, norm: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """A few of a decode layer's kernel calls: linear, RMSNorm, the in-place latent and rotary steps,
    SiLU gating, grouped experts, the router and the experts' weighted sum."""
    h = kernels.rms_norm(kernels.linear(x, w), norm, 1e-6)
    latent = kernels.mla_latent(h.clone(), norm[:24], 1e-6, cos, sin, True)
    rotated = kernels.rotate_tail(h.clone().view(-1, 4, 8), cos, sin, 8, True).flatten(1)
    gate, up = h.chunk(2, dim=-1)
    act = kernels.silu_mul(gate.contiguous(), up.contiguous())
    offsets = torch.tensor([0, 1, 3])
    y = kernels.grouped_linear(act, torch.stack([w[:, :16], w[:, 16:]]), offsets)
    gated = kernels.grouped_linear(h, torch.stack([w, w.flip(0)]), offsets, gated=True)
    weights, slot = kernels.moe_route(x[:, :4].contiguous(), norm[:4], 2, 2, 1, True, True, 2.5)
    latent_2 = h[:, 8:].clone()
    q, both = kernels.mla_input_norms(h[:, :8], norm[:8], 1e-6, latent_2, norm[:16], 1e-6, cos, sin, True)
    gate_weights, gate_ids = kernels.moe_gate(x, w[:4].contiguous(), None, 2, 1, 1, True, True, 1.0)
    extra = (q.sum() + both.sum() + gate_weights.sum() + gate_ids.sum()) * gated.sum(-1, keepdim=True)
    return kernels.moe_combine(y, slot % 3, weights, latent + rotated) + extra


@torch.inference_mode()
def test_cpu_kernels_trace_as_custom_ops():
    if not kernels.prepare_cpu_kernels():
        pytest.fail("the CPU kernels did not build")
    torch.manual_seed(0)
    args = (torch.randn(3, 32), torch.randn(32, 32), torch.rand(32) + 0.5, torch.rand(3, 4), torch.rand(3, 4))
    out, ops = compiled_ops(decode_layer_pieces, *args)
    names = {"rms_norm_cpu", "mla_latent_cpu", "rotate_tail_cpu", "silu_mul_cpu", "grouped_linear_cpu"}
    assert ops == names | {"moe_route_cpu", "moe_combine_cpu", "mla_input_norms_cpu", "moe_gate_cpu"}
    torch.testing.assert_close(out, decode_layer_pieces(*args), rtol=0, atol=0)


@torch.inference_mode()
def test_paged_mla_decode_traces_as_one_op():
    torch.manual_seed(1)
    q, pe = torch.randn(2, 4, 16), torch.randn(2, 4, 8)
    cache, table, lens = torch.randn(5, 4, 24), torch.tensor([[3, 1], [0, 4]]), torch.tensor([6, 3])
    out, ops = compiled_ops(lambda *a: kernels.paged_mla_decode(*a, 0.3), q, pe, cache, table, lens)
    assert ops == {"paged_mla_decode_cpu"}
    torch.testing.assert_close(out, kernels.paged_mla_decode(q, pe, cache, table, lens, 0.3), rtol=0, atol=0)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton runs on CPU tensors only interpreted"
)
@torch.inference_mode()
def test_triton_kernels_trace_as_custom_ops(monkeypatch):
    monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    torch.manual_seed(2)
    w, s = kernels.weight_quant(torch.randn(128, 256))
    x = torch.randn(3, 256)
    out, ops = compiled_ops(lambda *a: kernels.fp8_linear(*a), x, w, s)
    assert ops == {"act_quant_triton", "fp8_gemm_triton"}
    torch.testing.assert_close(out, kernels.fp8_linear(x, w, s), rtol=0, atol=0)
    q, pe = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    cache, table, lens = torch.randn(5, 16, 32), torch.tensor([[3, 1], [0, 4]]), torch.tensor([20, 9])
    out, ops = compiled_ops(lambda *a: kernels.paged_mla_decode(*a, 0.3), q, pe, cache, table, lens)
    assert ops == {"paged_mla_decode_triton"}
    torch.testing.assert_close(out, kernels.paged_mla_decode(q, pe, cache, table, lens, 0.3), rtol=0, atol=0)


def integer_linears(x: Tensor, w8: tuple[Tensor, Tensor], w4: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Each integer-weight entry point a model calls: a projection (INT8, W8A8 with and without the
    whole row's amax, INT4) and grouped experts (INT8, W8A8, INT4)."""
    offsets = torch.tensor([0, 1, 3])
    stack8 = [t.expand(2, *t.shape).contiguous() for t in w8]
    stack4 = [t.expand(2, *t.shape).contiguous() for t in w4]
    amax = x.abs().amax(dim=-1) * 2
    return torch.cat(
        [
            kernels.int8_linear(x, *w8),
            kernels.w8a8_linear(x, *w8),
            kernels.w8a8_linear(x, *w8, amax),
            kernels.int4_linear(x, *w4, 32),
            kernels.int8_grouped_linear(x, *stack8, offsets),
            kernels.w8a8_grouped_linear(x, *stack8, offsets),
            kernels.int4_grouped_linear(x, *stack4, offsets, 32),
        ],
        dim=-1,
    )


def integer_weights() -> tuple[Tensor, tuple[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]:
    torch.manual_seed(3)
    w = torch.randn(64, 128)
    return torch.randn(3, 128), kernels.int8_weight_quant(w), kernels.int4_weight_quant(w, 32)


@torch.inference_mode()
def test_integer_cpu_kernels_trace_as_custom_ops():
    if not kernels.prepare_cpu_kernels():
        pytest.fail("the CPU kernels did not build")
    args = integer_weights()
    out, ops = compiled_ops(integer_linears, *args)
    assert ops == {"int8_linear_cpu", "w8a8_linear_cpu", "int4_linear_cpu"}
    torch.testing.assert_close(out, integer_linears(*args), rtol=0, atol=0)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton runs on CPU tensors only interpreted"
)
@torch.inference_mode()
def test_integer_triton_kernels_trace_as_custom_ops(monkeypatch):
    """The projections run Triton (grouped experts take one launch per expert through the same ops)."""
    monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    x, w8, w4 = integer_weights()

    def projections(x: Tensor) -> Tensor:
        amax = x.abs().amax(dim=-1) * 2
        ys = [kernels.int8_linear(x, *w8), kernels.w8a8_linear(x, *w8, amax), kernels.int4_linear(x, *w4, 32)]
        return torch.cat([*ys, kernels.int8_act_quant(x)[0].float()], dim=-1)

    out, ops = compiled_ops(projections, x)
    assert ops == {"int8_linear_triton", "w8a8_linear_triton", "int4_linear_triton", "int8_act_quant_triton"}
    torch.testing.assert_close(out, projections(x), rtol=0, atol=0)


def test_cpu_kernels_run_without_the_gil():
    """While the engine thread is inside a kernel, another Python thread (a server's HTTP loop) runs: it
    ticks in the second half of the call. Holding the GIL, the call would let it tick only around its
    start and its return (the interpreter's switches: every 5 ms of bytecode)."""
    import threading
    import time

    if not kernels.prepare_cpu_kernels():
        pytest.fail("the CPU kernels did not build")
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    x, weight = torch.randn(64, 4096), torch.randn(8, 4096, 4096)  # a call of ~50 ms: 8 weights of 64 MB
    offsets = torch.arange(0, 65, 8)
    thread = threading.Thread(target=tick)
    thread.start()
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            kernels.grouped_linear(x, weight, offsets)
            end = time.perf_counter()
    finally:
        stop.set()
        thread.join(timeout=10)
    assert end - start > 0.02, "the call was too short to tell"
    assert any((start + end) / 2 < t < end - 0.005 for t in ticks), (start, end, ticks)


def test_the_cpus_bf16_units_are_a_constant_of_a_traced_step():
    """Which GEMM fp32 rows meet bf16 weights in (the absorbed MLA products at large batches) depends on
    the CPU's flags: a traced step takes them as a constant, as /proc/cpuinfo cannot be read while
    tracing (a bf16 model's compiled step failed to trace there)."""
    x = torch.randn(2, 4)
    got, _ = compiled_ops(lambda t: t * 2 if kernels.bf16_gemm_units(t) else t - 1, x)
    assert torch.equal(got, x * 2 if kernels.bf16_gemm_units(x) else x - 1)
