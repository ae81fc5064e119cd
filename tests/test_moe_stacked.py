"""Stacked experts (one batched GEMM per projection for small batches) against one GEMM per expert."""

from __future__ import annotations

import pytest
import torch
from tiny_models import V3_BASE

from model.config import args_from_hf_config
from model.moe import STACKED_MAX_ROWS, MoE


def _random_moe(seed: int) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(args_from_hf_config({**V3_BASE, "n_group": 1, "topk_group": 1}))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return moe.eval().requires_grad_(False)


@pytest.mark.parametrize("tokens", [1, 8, 64, 4 * STACKED_MAX_ROWS])
def test_stacked_experts_match_expert_by_expert(tokens):
    moe = _random_moe(seed=tokens)
    x = torch.randn(tokens, moe.gate.weight.shape[1])
    expected = moe(x)
    weights_before = {n: p.clone() for n, p in moe.named_parameters()}
    moe.stack_experts()
    assert moe.gate_up is not None and moe.down is not None
    # The experts' own weights are now views of the stacks, with unchanged values.
    assert moe.experts["3"].down_proj.weight.data_ptr() == moe.down[3].data_ptr()
    for name, p in moe.named_parameters():
        assert torch.equal(p, weights_before[name]), name
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)


def test_stacked_path_is_taken_for_decode_sized_groups(monkeypatch):
    moe = _random_moe(seed=0)
    moe.stack_experts()
    calls = []
    original = moe.run_stacked
    monkeypatch.setattr(moe, "run_stacked", lambda *a: calls.append(1) or original(*a))
    moe(torch.randn(16, moe.gate.weight.shape[1]))  # 32 rows over 8 experts: stacked
    assert calls
    calls.clear()
    moe(torch.randn(1, moe.gate.weight.shape[1]))  # 2 of 8 experts busy: expert by expert
    assert not calls


def test_fp8_experts_are_left_unstacked():
    moe = _random_moe(seed=1)
    for mlp in moe.experts.values():
        mlp.gate_proj.weight = torch.nn.Parameter(
            mlp.gate_proj.weight.to(torch.float8_e4m3fn), requires_grad=False
        )
    moe.stack_experts()
    assert moe.gate_up is None
