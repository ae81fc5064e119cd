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


@pytest.mark.parametrize(("m", "k"), [(4, 2048), (200, 1024)], ids=["small-m-split-k", "large-m"])
def test_fp8_gemm_autotuned_paths_match_reference(m, k):
    """The decode path (M <= 64: swapped operands, K split 4 ways on any GPU with >= 12 SMs) and the prefill
    tiles, each autotuned over its list, against the reference."""
    from moelaunch.kernels import fp8_triton

    g = torch.Generator(device="cuda").manual_seed(4)
    x_q, x_s = kernels.act_quant(torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16))
    w_q, w_s = ref.weight_quant_ref(torch.randn(384, k, device="cuda", generator=g) * 0.05)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert m > fp8_triton.SMALL_M or fp8_triton.split_k_for(m, 384, k, sms) == 4
    out, launched = run_on_gpu(lambda: kernels.fp8_gemm(x_q, x_s, w_q, w_s, out_dtype=torch.float32))
    assert any("_fp8_gemm_kernel" in name for name in launched), launched
    expected = ref.fp8_gemm_ref(x_q, x_s, w_q, w_s, out_dtype=torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_mla_decode_compiled_matches_reference(dtype, heads):
    """Five rows: the sequence is split (one wave over the SMs) and combined; 128 heads in tiles of 64
    (bf16) or 32 (fp32)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    rows, c_dim, p_dim, block_size = 5, 512, 64, 64
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
    # Few graph buckets: the defaults (compile and graphs for every bucket up to 256 sequences) would
    # spend minutes at start-up on what three prompts never use.
    with LLM(
        str(path), dtype="float32", kv_cache_memory=4_000_000, max_num_seqs=8, cuda_graph_sizes=[1, 4]
    ) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    # Random tiny models have near-tied logits; TF32 attention may flip a late tie, never most tokens.
    agree = sum(a == b for e, o in zip(expected, got, strict=True) for a, b in zip(e, o, strict=True))
    assert got[0][0] == expected[0][0] and agree >= 0.9 * sum(map(len, expected))


# --- each inference option on the GPU, compiled: the Triton kernel must show up as a CUDA kernel ------


def run_on_gpu(fn):
    """fn()'s result and the names of the CUDA kernels it launched: an interpreted Triton kernel runs
    on the host and launches none under its name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, {e.name for e in prof.events() if e.device_type == DeviceType.CUDA}


def test_the_triton_kernels_are_compiled_not_interpreted():
    import os

    assert os.environ.get("TRITON_INTERPRET") != "1", "tests/conftest.py interprets Triton only without a GPU"


@pytest.mark.parametrize("method", ["int8", "w8a8", "int4"])
def test_integer_weights_run_compiled_on_the_gpu(method):
    from moelaunch.kernels import int4_reference, int8_reference

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 256, generator=g)
    w = torch.randn(192, 256, generator=g) * 0.05
    if method == "int4":
        stored = int4_reference.int4_weight_quant_ref(w)
        expected = int4_reference.int4_linear_ref(x, *stored, 128)
        call, kernel = (
            (lambda: kernels.int4_linear(x.cuda(), *(t.cuda() for t in stored), 128)),
            "_int4_linear",
        )
    else:
        stored = int8_reference.int8_weight_quant_ref(w)
        reference = int8_reference.w8a8_linear_ref if method == "w8a8" else int8_reference.int8_linear_ref
        expected = reference(x, *stored)
        op = kernels.w8a8_linear if method == "w8a8" else kernels.int8_linear
        call = lambda: op(x.cuda(), *(t.cuda() for t in stored))  # noqa: E731
        kernel = "_int8_gemm" if method == "w8a8" else "_int8_linear"
    out, launched = run_on_gpu(call)
    assert any(kernel in name for name in launched), launched
    magnitude = x.abs() @ w.abs().T  # TF32 inputs (weight-only paths): 2^-10 of the terms' sum
    assert ((out.cpu().float() - expected.float()).abs() <= TF32_UNIT * magnitude + 1e-4).all()


@pytest.mark.parametrize("variant", ["kv-fp8", "window", "topk"])
def test_cache_variants_decode_compiled_on_the_gpu(tmp_path, variant):
    """The latent cache's decode on CUDA against the same cache on the CPU: an FP8 cache, a sliding window
    and top-k blocks, each through the compiled MLA decode kernel."""
    from moelaunch.model.config import load_args
    from moelaunch.model.kv_cache import PagedLatentCache, SparseAttention

    args = load_args(make_hf_model(tmp_path / "tiny", "v3"))
    sparse = {"window": SparseAttention(window=9), "topk": SparseAttention(topk_blocks=2)}.get(variant)
    g = torch.Generator().manual_seed(3)
    block_size, n_blocks, rows, heads = 4, 24, 3, 8
    width = args.kv_lora_rank + args.qk_rope_head_dim
    seq_lens = torch.tensor([5, 17, 30], dtype=torch.int32)
    table = torch.randperm(n_blocks, generator=g)[: rows * 8].view(rows, 8).to(torch.int32)
    slots = torch.cat([table[r, : -(-n // block_size)].long().repeat_interleave(block_size) * block_size
                       + torch.arange(-(-n // block_size) * block_size) % block_size
                       for r, n in enumerate(seq_lens.tolist())])  # fmt: skip
    latent = torch.randn(len(slots), width, generator=g)
    q_latent = torch.randn(rows, heads, args.kv_lora_rank, generator=g)
    q_pe = torch.randn(rows, heads, args.qk_rope_head_dim, generator=g)
    tensors = (q_latent, q_pe, table, seq_lens)
    outputs = []
    for device in ("cpu", "cuda"):
        cache = PagedLatentCache(
            args, n_blocks, block_size, [0], torch.float32, device, variant == "kv-fp8", sparse
        )
        cache.store(0, slots.to(device), latent.to(device))
        outputs.append(
            run_on_gpu(lambda c=cache, d=device: c.decode(0, *(t.to(d) for t in tensors), width**-0.5))
        )
    (cpu_out, _), (gpu_out, launched) = outputs
    assert any("_paged_mla_decode" in name for name in launched), launched
    # convex combinations of cache rows; TF32 scores move the weights by ~2^-10 of |score|
    assert (gpu_out.cpu() - cpu_out).abs().max() <= 0.05


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_grouped_moe_gemm_runs_compiled_on_the_gpu(fp8):
    """Both projections of every expert, one compiled launch each, against the torch reference on the
    CPU (empty experts, uneven counts, widths that are not whole 128-blocks)."""
    from test_kernels_moe_grouped import COUNTS, HIDDEN, Experts, offsets_of

    dtype = torch.float32 if fp8 else torch.bfloat16  # fp32 rows: FP8 quantizes them alike on both
    experts = Experts(len(COUNTS), seed=10, fp8=fp8, dtype=torch.bfloat16)
    x = torch.randn(sum(COUNTS), HIDDEN, generator=torch.Generator().manual_seed(11)).to(dtype)
    args = (x, offsets_of(COUNTS), experts.gate_up, experts.down_w, experts.gate_up_scale, experts.down_scale)
    expected = kernels.moe_experts(*args)
    on_gpu = [t.cuda() if t is not None else None for t in args]
    out, launched = run_on_gpu(lambda: kernels.moe_experts(*on_gpu))
    assert sum("_moe_gemm_kernel" in name for name in launched) >= 1, launched
    assert out.dtype == dtype and out.shape == expected.shape
    # bf16: the hidden rows and the output each one bf16 rounding (possibly on either side); FP8: the
    # same quantized products, summed in another order.
    tolerance = (2**-6 if not fp8 else 1e-4) * expected.float().abs().max().item()
    assert (out.cpu().float() - expected.float()).abs().max().item() <= tolerance
