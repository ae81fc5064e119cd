"""The compiled (not interpreted) Triton kernels and the engine on a CUDA GPU, against the torch references
and the CPU path. These run on a GPU machine only; CI has none, so they are the one expected skip there
(tests/conftest.py EXPECTED_SKIPS)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch import kernels
from moelaunch.kernels import fp8_reference as ref
from moelaunch.kernels import mla_decode_reference as mla_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Triton's fp32 dots on tensor cores round their inputs to TF32 (10-bit mantissa): a relative 2^-10 per
# product, summed over K terms, bounded here by that much of the sum of |terms|.
TF32_UNIT = 2.0**-10


def test_fp8_linear_compiled_matches_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(7, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    w_q, w_s = ref.weight_quant_ref(torch.randn(384, 512, device="cuda", generator=g) * 0.05)
    x_q, x_s = kernels.act_quant(x)
    ref_q, ref_s = ref.act_quant_ref(x)
    assert torch.equal(x_s, ref_s) and torch.equal(x_q.float(), ref_q.float())
    out = kernels.fp8_gemm(x_q, x_s, w_q, w_s, out_dtype=torch.float32)
    expected = ref.fp8_gemm_ref(x_q, x_s, w_q, w_s, out_dtype=torch.float32)
    magnitude = (x_q.float().abs() * x_s.repeat_interleave(128, -1)) @ ref.weight_dequant_ref(
        w_q, w_s, out_dtype=torch.float32
    ).abs().T
    assert ((out - expected).abs() <= 1e-5 * magnitude + 1e-6).all()
    dense = kernels.weight_dequant(w_q, w_s, out_dtype=torch.float32)
    assert torch.equal(dense, ref.weight_dequant_ref(w_q, w_s, out_dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_mla_decode_compiled_matches_reference(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    rows, heads, c_dim, p_dim, block_size = 5, 16, 512, 64, 64
    seq_lens = torch.tensor([1, 64, 131, 700, 4096], dtype=torch.int32, device="cuda")
    blocks_each = (seq_lens + block_size - 1) // block_size
    num_blocks = int(blocks_each.sum())
    order = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    table = torch.full((rows, int(blocks_each.max())), -1, dtype=torch.int32, device="cuda")
    start = 0
    for r, n in enumerate(blocks_each.tolist()):
        table[r, :n] = order[start : start + n]
        start += n
    cache = torch.randn(num_blocks, block_size, c_dim + p_dim, device="cuda", generator=g).to(dtype)
    q_latent = torch.randn(rows, heads, c_dim, device="cuda", generator=g).to(dtype)
    q_pe = torch.randn(rows, heads, p_dim, device="cuda", generator=g).to(dtype)
    scale = (c_dim + p_dim) ** -0.5
    out = kernels.paged_mla_decode(q_latent, q_pe, cache, table, seq_lens, scale)
    expected = mla_ref.paged_mla_decode_ref(q_latent, q_pe, cache, table, seq_lens, scale)
    # Outputs are convex combinations of cache rows (|c| <~ 5); TF32 scores shift the weights by ~2^-10
    # relative to |score| (~30 here), and bf16 outputs add their own rounding.
    tolerance = 0.05 if dtype == torch.float32 else 0.1
    assert (out.float() - expected.float()).abs().max() <= tolerance


def test_engine_on_cuda_gives_the_cpu_tokens(tmp_path):
    from moelaunch.launcher import LLM, SamplingParams
    from moelaunch.model import load_model
    from moelaunch.model.single_sequence import generate

    path = add_byte_tokenizer(make_hf_model(tmp_path / "tiny", "v3"))
    prompts = [[5, 6, 7, 8, 9], [3] * 11, [9, 10]]
    cpu_model = load_model(path)
    expected = [generate(cpu_model, p, 12, 0.0) for p in prompts]
    with LLM(str(path), dtype="float32", kv_cache_memory=4_000_000) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    # Random tiny models have near-tied logits; TF32 attention may flip a late tie, never most tokens.
    agree = sum(a == b for e, o in zip(expected, got, strict=True) for a, b in zip(e, o, strict=True))
    assert got[0][0] == expected[0][0] and agree >= 0.9 * sum(map(len, expected))
