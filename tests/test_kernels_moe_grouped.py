"""The grouped MoE GEMM (kernels/moe_grouped*.py): Triton under the interpreter and the torch reference
against expert-by-expert products written with plain torch and `kernels.fp8_linear` (the path each
expert's own Linear takes), over rows sorted by expert with empty experts, uneven counts and runs that
are not a whole number of tiles; bf16, fp32 and block-FP8 W8A8; SiLU gating and row weights."""

from __future__ import annotations

import os
import random
from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F
from test_kernel_ops import compiled_ops
from torch import Tensor

from moelaunch import kernels
from moelaunch.kernels import moe_grouped

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton runs on CPU tensors only interpreted"
)
# Rows per expert: empty experts first, in the middle and last; 17 and 40 are not whole 16-row tiles.
COUNTS = [0, 5, 17, 0, 1, 40, 0]
HIDDEN, INTER = 192, 96  # neither a whole number of 128-blocks: FP8 pads both


def offsets_of(counts: list[int]) -> Tensor:
    return torch.tensor(list(accumulate(counts, initial=0)))


class Experts:
    """Random experts: [gate; up] [E, 2I, D] and down [E, D, I], plain or block-FP8 (each projection
    quantized on its own, as a checkpoint holds it, then stacked)."""

    def __init__(self, n: int, seed: int, fp8: bool, dtype: torch.dtype = torch.float32) -> None:
        g = torch.Generator().manual_seed(seed)
        self.gate, self.up = (torch.randn(n, INTER, HIDDEN, generator=g) * 0.1 for _ in range(2))
        self.down = torch.randn(n, HIDDEN, INTER, generator=g) * 0.1
        self.fp8 = fp8
        if fp8:
            self.q = {
                name: [kernels.weight_quant(w) for w in getattr(self, name)]
                for name in ("gate", "up", "down")
            }
            self.gate_up = torch.stack(
                [torch.cat([g[0], u[0]]) for g, u in zip(self.q["gate"], self.q["up"], strict=True)]
            )
            self.gate_up_scale = torch.stack(
                [torch.cat([g[1], u[1]]) for g, u in zip(self.q["gate"], self.q["up"], strict=True)]
            )
            self.down_w = torch.stack([q for q, _ in self.q["down"]])
            self.down_scale = torch.stack([s for _, s in self.q["down"]])
        else:
            self.gate_up = torch.cat([self.gate, self.up], dim=1).to(dtype)
            self.down_w = self.down.to(dtype)
            self.gate_up_scale = self.down_scale = None

    def linear(self, name: str, e: int, x: Tensor) -> Tensor:
        """Expert e's projection alone, as its Linear runs it."""
        if self.fp8:
            return kernels.fp8_linear(x, *self.q[name][e])
        w = {"gate": self.gate_up[e, :INTER], "up": self.gate_up[e, INTER:], "down": self.down_w[e]}[name]
        return (x.float() @ w.float().T).to(x.dtype)

    def one_by_one(self, x: Tensor, counts: list[int], stage: str) -> Tensor:
        """stage "gate_up": silu(gate) * up per expert; "down": the down projection; "mlp": both."""
        outs = []
        bounds = offsets_of(counts).tolist()
        for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            rows = x[lo:hi]
            if stage in ("gate_up", "mlp"):
                rows = F.silu(self.linear("gate", e, rows).float()).to(x.dtype) * self.linear("up", e, rows)
            if stage in ("down", "mlp"):
                rows = self.linear("down", e, rows)
            outs.append(rows)
        return torch.cat(outs)


def assert_near(got: Tensor, expected: Tensor, rel: float) -> None:
    """Within rel of the result's largest magnitude (the products summed in another order; bf16 outputs
    one rounding apart)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= rel * expected.float().abs().max().item(), err


@pytest.fixture(params=["reference", "triton"])
def implementation(request, monkeypatch):
    if request.param == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.fail("tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU")
        monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    return request.param


@pytest.mark.parametrize(
    ("fp8", "dtype", "rel"),
    [(False, torch.float32, 1e-5), (False, torch.bfloat16, 2**-7), (True, torch.float32, 1e-5)],
)
def test_each_projection_matches_expert_by_expert(implementation, fp8, dtype, rel):
    experts = Experts(len(COUNTS), seed=1, fp8=fp8, dtype=dtype)
    offsets = offsets_of(COUNTS)
    x = torch.randn(sum(COUNTS), HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    h = kernels.moe_grouped_gemm(x, offsets, experts.gate_up, experts.gate_up_scale, silu=True)
    assert_near(h, experts.one_by_one(x, COUNTS, "gate_up"), rel)
    y = kernels.moe_grouped_gemm(h, offsets, experts.down_w, experts.down_scale)
    assert_near(y, experts.one_by_one(h, COUNTS, "down"), rel)
    weights = torch.rand(h.shape[0], generator=torch.Generator().manual_seed(3))
    scaled = kernels.moe_grouped_gemm(h, offsets, experts.down_w, experts.down_scale, row_weights=weights)
    assert_near(scaled, (y.float() * weights[:, None]).to(dtype), rel)


@pytest.mark.parametrize(
    "counts", [[0, 1, 0, 0, 2, 0, 0, 0], [130, 0, 0, 0], [0, 0, 0]], ids=["few", "one", "none"]
)
def test_fewer_rows_than_experts_one_busy_expert_and_no_rows(implementation, counts):
    experts = Experts(len(counts), seed=4, fp8=True)
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(5))
    y = kernels.moe_experts(
        x, offsets_of(counts), experts.gate_up, experts.down_w, experts.gate_up_scale, experts.down_scale
    )
    assert y.shape == (sum(counts), HIDDEN)
    if sum(counts):
        assert_near(y, experts.one_by_one(x, counts, "mlp"), 1e-5)


def test_fp8_activations_are_quantized_once_per_projection_not_per_expert(implementation, monkeypatch):
    experts = Experts(len(COUNTS), seed=6, fp8=True)
    quantized = []
    original = moe_grouped.act_quant
    monkeypatch.setattr(moe_grouped, "act_quant", lambda x: quantized.append(x.shape) or original(x))
    x = torch.randn(sum(COUNTS), HIDDEN, generator=torch.Generator().manual_seed(7))
    y = kernels.moe_experts(
        x, offsets_of(COUNTS), experts.gate_up, experts.down_w, experts.gate_up_scale, experts.down_scale
    )
    assert_near(y, experts.one_by_one(x, COUNTS, "mlp"), 1e-5)
    # every row at once, K padded to whole 128-blocks: the hidden rows come out padded (I = 96 -> 128)
    assert quantized == [(x.shape[0], 256), (x.shape[0], 128)]


def test_the_grid_bound_covers_every_routing():
    """The static grid's row tiles: no routing of R rows over E experts needs more."""
    rng = random.Random(0)
    from moelaunch.kernels.moe_grouped_triton import block_m_for, max_tiles

    for _ in range(2000):
        experts, rows = rng.randint(1, 300), rng.randint(0, 3000)
        cuts = sorted(rng.randint(0, rows) for _ in range(experts - 1))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]
        block = block_m_for(rows, experts)
        assert sum(-(-c // block) for c in counts) <= max_tiles(rows, experts, block)


def test_the_reference_reads_nothing_back():
    """It serves the static decode step on the CPU: no sync, no data-dependent shape (StepOps raises)."""
    from moelaunch.engine.step_ops import StepOps

    experts = Experts(len(COUNTS), seed=8, fp8=True)
    x = torch.randn(sum(COUNTS), HIDDEN)
    with StepOps(strict=True):
        kernels.moe_experts(
            x, offsets_of(COUNTS), experts.gate_up, experts.down_w, experts.gate_up_scale, experts.down_scale
        )


@needs_interpreter
@torch.inference_mode()
@pytest.mark.parametrize("fp8", [False, True])
def test_traces_as_one_op_per_projection(monkeypatch, fp8):
    monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    experts = Experts(len(COUNTS), seed=9, fp8=fp8)
    args = (torch.randn(sum(COUNTS), HIDDEN), offsets_of(COUNTS), experts.gate_up, experts.down_w)
    scales = (experts.gate_up_scale, experts.down_scale)
    out, ops = compiled_ops(lambda *a: kernels.moe_experts(*a, *scales), *args)
    assert ops == ({"act_quant_triton", "moe_grouped_gemm_triton"} if fp8 else {"moe_grouped_gemm_triton"})
    torch.testing.assert_close(out, kernels.moe_experts(*args, *scales), rtol=0, atol=0)
