"""The KV cache options of issue 20: an fp8 latent cache, and two approximations of attention for long
contexts (a sliding window and sparse top-k blocks), each against an explicit plain-torch reference."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import add_byte_tokenizer, make_hf_model
from torch import Tensor

from moelaunch import kernels
from moelaunch.kernels import dequantize_latent, quantize_latent
from moelaunch.kernels import mla_decode_cpu as mla_cpu
from moelaunch.kernels import mla_decode_reference as ref
from moelaunch.kernels.selection import bf16_dot_products
from moelaunch.launcher import LLM, SamplingParams
from moelaunch.model import PagedLatentCache, SparseAttention, load_args, load_model
from moelaunch.model.config import ModelArgs
from moelaunch.tasks.problem_sets import held_out_sample, messages
from moelaunch.tasks.tasks import is_correct

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Long enough for several blocks of 4 and for a window of 8 to cut most of each sequence.
PROMPTS = [[0] + list(range(5, 41)), [0, 9, 10, 11, 12], [0] + [7, 8, 9] * 7]
E4M3_STEP = 2.0**-4  # relative half-ulp of e4m3's 3-bit mantissa
E4M3_SUBNORMAL_STEP = 2.0**-10  # half the spacing of e4m3 subnormals (2^-9)

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels run on CPU tensors only when interpreted",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(add_byte_tokenizer(make_hf_model(tmp_path_factory.mktemp("tiny"), "v3", num_hidden_layers=2)))


@pytest.fixture(scope="module")
def baseline(checkpoint) -> list[list[int]]:
    with LLM(checkpoint, kv_cache_memory=4_000_000, block_size=4) as llm:
        return tokens_of(llm, PROMPTS)


def tokens_of(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def latent_args(c_dim: int, p_dim: int) -> ModelArgs:
    """One layer of the tiny config with the given latent shape: all a cache reads from the args."""
    tiny = load_args(REPO / "configs/models/tiny-v3.json")
    return dataclasses.replace(tiny, kv_lora_rank=c_dim, qk_rope_head_dim=p_dim, num_hidden_layers=1)


def _latents(g: torch.Generator, shape: tuple[int, ...], c_dim: int, p_dim: int) -> Tensor:
    """c_kv near 1 (as after its RMSNorm), k_pe a hundred times larger and with a wide spread."""
    c = torch.randn(*shape, c_dim, generator=g)
    pe = torch.randn(*shape, p_dim, generator=g) * torch.rand(*shape, 1, generator=g) * 100
    return torch.cat([c, pe], dim=-1)


# ---- fp8 cache: storage ----


def test_fp8_store_and_gather_round_trip_within_the_e4m3_bound():
    args = latent_args(32, 8)
    cache = PagedLatentCache(args, num_blocks=6, block_size=4, fp8=True)
    latent = _latents(torch.Generator().manual_seed(0), (18,), 32, 8)
    table = torch.tensor([5, 2, 0, 3, 1])
    slots = table[torch.arange(18) // 4] * 4 + torch.arange(18) % 4
    cache.store(0, slots, latent)
    kv, pe = cache.gather(0, table, 18)
    back = torch.cat([kv, pe], dim=-1)
    # Per element of the scaled value v = x / s (|v| <= 448): |v - fp8(v)| <= 2^-4 |v|, or half a
    # subnormal step near zero.
    scales = cache.scales[0].view(-1, 2)[slots]
    per_value = torch.cat([scales[:, :1].expand(-1, 32), scales[:, 1:].expand(-1, 8)], dim=-1)
    v, v_back = latent / per_value, back / per_value
    assert ((v - v_back).abs() <= E4M3_STEP * v.abs() + E4M3_SUBNORMAL_STEP).all()
    assert v.abs().amax(dim=-1).sub(448).abs().max() < 1e-3  # each row's largest value maps to e4m3's max
    # Half the bytes of bf16 plus two fp32 scales.
    assert PagedLatentCache.bytes_per_token(args, 1, torch.bfloat16, fp8=True) == 40 + 8
    assert PagedLatentCache.bytes_per_token(args, 1, torch.bfloat16) == 80


def test_each_part_keeps_its_own_scale():
    """A c_kv part 100x smaller than k_pe keeps e4m3's relative precision (<= 2^-4 of each value), and
    each part's largest magnitude is stored as 448: one scale shared by both parts would leave c_kv in
    a few mantissa steps or in subnormals."""
    g = torch.Generator().manual_seed(0)
    c_dim = 32
    c_kv = 0.01 * (torch.rand(5, c_dim, generator=g) + 0.5) * torch.sign(torch.randn(5, c_dim, generator=g))
    k_pe = (torch.rand(5, 8, generator=g) + 0.5) * torch.sign(torch.randn(5, 8, generator=g))
    latent = torch.cat([c_kv, k_pe], dim=-1)
    values, scales = quantize_latent(latent, c_dim)
    back = dequantize_latent(values, scales, c_dim)
    relative = ((back - latent) / latent).abs()
    assert relative[:, :c_dim].max() <= 2**-4 and relative[:, c_dim:].max() <= 2**-4
    stored = values.float().abs()
    assert torch.equal(stored[:, :c_dim].amax(-1), torch.full((5,), 448.0))
    assert torch.equal(stored[:, c_dim:].amax(-1), torch.full((5,), 448.0))


def test_zero_rows_quantize_to_zero():
    values, scales = quantize_latent(torch.zeros(3, 12), 8)
    assert torch.equal(dequantize_latent(values, scales, 8), torch.zeros(3, 12))


# ---- fp8 cache and windows in the decode kernels ----


def _paged(g: torch.Generator, seq_lens: list[int], c_dim: int = 40, p_dim: int = 8, block_size: int = 4):
    """Sequences of latents paged into shuffled blocks (spare slots NaN): (latents per row, cache,
    block table [R, max_blocks])."""
    n_blocks = [-(-n // block_size) for n in seq_lens]
    total = sum(n_blocks) + 2
    cache = torch.full((total, block_size, c_dim + p_dim), float("nan"))
    order = torch.randperm(total, generator=g).tolist()
    table = torch.full((len(seq_lens), max(n_blocks)), -1, dtype=torch.int32)
    seqs = []
    for r, n in enumerate(seq_lens):
        tokens = _latents(g, (n,), c_dim, p_dim)
        seqs.append(tokens)
        for b in range(n_blocks[r]):
            block = order.pop()
            table[r, b] = block
            part = tokens[b * block_size : (b + 1) * block_size]
            cache[block, : part.shape[0]] = part
    return seqs, cache, table


def _quantized(cache: Tensor, c_dim: int) -> tuple[Tensor, Tensor]:
    """The fp8 cache and its scales (NaN slots stay unread garbage), made in torch: the interpreter's
    float -> fp8 cast is not exact."""
    return quantize_latent(torch.nan_to_num(cache), c_dim)


def _decode_loop(q: Tensor, q_pe: Tensor, seqs: list[Tensor], starts: list[int], scale: float) -> Tensor:
    """Per row, plain attention over its tokens starts[r]..end in float64."""
    c_dim = q.shape[-1]
    out = []
    for r, tokens in enumerate(seqs):
        t = tokens[starts[r] :].double()
        scores = q[r].double() @ t[:, :c_dim].T + q_pe[r].double() @ t[:, c_dim:].T
        out.append((scores * scale).softmax(dim=-1) @ t[:, :c_dim])
    return torch.stack(out).float()


@pytest.fixture(params=["reference", "cpu", "triton"])
def decode(request):
    """A paged decode implementation with the reference's signature."""
    if request.param == "reference":
        return ref.paged_mla_decode_ref
    if request.param == "cpu":
        assert kernels.prepare_cpu_kernels(), "the C++ kernels must build here (g++ and ninja are installed)"

        def cpu(q, q_pe, cache, table, seq_lens, scale, cache_scales=None, starts=None):
            return mla_cpu.paged_mla_decode_cpu(q, q_pe, cache, table, seq_lens, scale, starts, cache_scales)

        return cpu
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels run on CPU tensors only when interpreted")
    from moelaunch.kernels import mla_decode_triton

    return mla_decode_triton.paged_mla_decode_triton


def test_fp8_cache_decode_against_the_dequantized_and_the_unquantized_cache(decode, isa_path):
    """On each instruction-set path (the C++ kernel: 16-lane FMAs from avx512 on, 8-lane below)."""
    g = torch.Generator().manual_seed(1)
    lens = [13, 4, 9]
    seqs, cache, table = _paged(g, lens)
    q, q_pe = torch.randn(3, 5, 40, generator=g), torch.randn(3, 5, 8, generator=g) / 10
    values, scales = _quantized(cache, 40)
    seq_lens, scale = torch.tensor(lens), 40**-0.5
    out = decode(q, q_pe, values, table, seq_lens, scale, scales)
    # Tight: the same attention over the dequantized values, so only fp32 rounding differs.
    dequantized = dequantize_latent(values, scales, 40)
    exact = ref.paged_mla_decode_ref(q, q_pe, dequantized, table, seq_lens, scale)
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)
    # Loose: against the unquantized latents, the output (an average of c rows of size ~1) moves by the
    # fp8 rounding of c (2^-4 relative at most) and of the scores (large here: k_pe up to ~300): we state
    # 0.15 absolute (0.09 measured).
    full = _decode_loop(q, q_pe, seqs, [0] * 3, scale)
    error = (out - full).abs().max().item()
    print(f"fp8 cache decode: max |error| vs the unquantized cache {error:.4f}")
    assert error < 0.15


def _read_in_bf16(fp8_as: torch.dtype) -> bool:
    """Whether the C++ kernel reads an fp8 cache standing in for an `fp8_as` cache in bf16 here: the
    values its codes dequantize to rounded to bf16, and fp32 queries too (a CPU with bf16 products)."""
    return fp8_as == torch.bfloat16 and bf16_dot_products()


@pytest.mark.parametrize("fp8_as", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zeros", [0, 2])
def test_cpu_kernel_reads_every_fp8_code_exactly(isa_path, zeros, fp8_as):
    """One cached token per row: attention returns its c_kv part as the kernel dequantized it (weight
    exactly 1), so every e4m3 code (subnormals, both zeros, the largest) must come out as torch reads it,
    times the token's scale (then rounded to bf16 where it is read in bf16), on each instruction-set path.
    NaN codes are left out: a cache never holds them. Two zeros more make the widths the AMX tiles'
    (256 + 32): their dequantization a 16-token piece at a time, the other shape's a block at a time."""
    assert kernels.prepare_cpu_kernels()
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.cat([codes[(codes & 0x7F) != 0x7F], torch.zeros(zeros, dtype=torch.uint8)])  # 254 codes
    c_dim, p_dim = codes.numel(), 8 if zeros == 0 else 32
    values = torch.zeros(2, 1, c_dim + p_dim, dtype=torch.uint8)
    values[:, 0, :c_dim] = codes
    values = values.view(torch.float8_e4m3fn)
    scales = torch.tensor([[[1.0, 1.0]], [[0.375, 2.0]]])
    table, seq_lens = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([1, 1])
    q, q_pe = torch.randn(2, 3, c_dim), torch.randn(2, 3, p_dim)
    out = mla_cpu.paged_mla_decode_cpu(q, q_pe, values, table, seq_lens, 0.1, None, scales, fp8_as)
    expected = values[:, 0, :c_dim].float() * scales[:, 0, :1]
    if _read_in_bf16(fp8_as):
        expected = expected.bfloat16().float()
    assert torch.equal(out, expected[:, None].expand(2, 3, c_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_cache_stands_in_for_the_cache_of_its_dtype(dtype):
    """The cache's decode tells the kernel which float cache its fp8 values stand in for: a bf16 model's
    are read in bf16 where the CPU multiplies bf16, an fp32 model's in fp32."""
    assert kernels.prepare_cpu_kernels()
    c_dim, p_dim = 64, 32
    cache = PagedLatentCache(latent_args(c_dim, p_dim), 8, 16, dtype=dtype, fp8=True)
    g = torch.Generator().manual_seed(6)
    table, lens = torch.tensor([[3, 5], [1, 0]]), torch.tensor([20, 9])
    for r, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        cache.store(0, table[r, pos // 16] * 16 + pos % 16, _latents(g, (n,), c_dim, p_dim) / 10)
    q, q_pe = torch.randn(2, 4, c_dim, generator=g), torch.randn(2, 4, p_dim, generator=g)
    out = cache.decode(0, q, q_pe, table, lens, 0.1)
    kernel = [
        mla_cpu.paged_mla_decode_cpu(q, q_pe, cache.pool[0], table, lens, 0.1, None, cache.scales[0], fp8_as)
        for fp8_as in (torch.float32, torch.bfloat16)
    ]
    assert torch.equal(out, kernel[dtype == torch.bfloat16])
    assert torch.equal(kernel[0], kernel[1]) != bf16_dot_products()  # the two readings differ there


@pytest.mark.parametrize("fp8_as", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("c_dim", "p_dim"), [(40, 8), (64, 32)])  # (64, 32): the AMX tiles' widths
def test_fp8_cache_reads_as_the_float_cache_it_stands_in_for(isa_path, c_dim, p_dim, fp8_as):
    """Rows of several 16-token pieces, short ones, and start positions: on every instruction-set path
    the fp8 kernel gives bit for bit what the same kernel gives over the float cache of the values its
    codes dequantize to: bf16 ones where it reads them in bf16 (the tiles a piece at a time, vdpbf16ps a
    block at a time), fp32 ones elsewhere."""
    assert kernels.prepare_cpu_kernels()
    g = torch.Generator().manual_seed(5)
    lens, starts = [37, 16, 5, 70], [0, 3, 0, 21]
    _, cache, table = _paged(g, lens, c_dim=c_dim, p_dim=p_dim, block_size=16)
    q, q_pe = torch.randn(4, 9, c_dim, generator=g), torch.randn(4, 9, p_dim, generator=g) / 10
    values, scales = _quantized(cache, c_dim)
    read_as = torch.bfloat16 if _read_in_bf16(fp8_as) else torch.float32
    read = dequantize_latent(values, scales, c_dim, read_as)
    args = (table, torch.tensor(lens), (c_dim + p_dim) ** -0.5)
    for first in (None, torch.tensor(starts)):
        out = mla_cpu.paged_mla_decode_cpu(q, q_pe, values, *args, first, scales, fp8_as)
        assert torch.equal(out, mla_cpu.paged_mla_decode_cpu(q, q_pe, read, *args, first))


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_from_a_start_position_drops_the_earlier_tokens(decode, fp8):
    g = torch.Generator().manual_seed(2)
    lens, starts = [13, 4, 9], [6, 0, 8]
    seqs, cache, table = _paged(g, lens)
    q, q_pe = torch.randn(3, 5, 40, generator=g), torch.randn(3, 5, 8, generator=g) / 10
    # Blocks wholly before a start are never read: mark them freed (-1), as the engine does.
    table[0, 0] = -1
    table[2, :2] = -1
    scale = 40**-0.5
    if fp8:
        values, scales = _quantized(cache, 40)
        seqs = [dequantize_latent(*quantize_latent(s, 40), 40) for s in seqs]
    else:
        values, scales = cache, None
    out = decode(q, q_pe, values, table, torch.tensor(lens), scale, scales, torch.tensor(starts))
    torch.testing.assert_close(out, _decode_loop(q, q_pe, seqs, starts, scale), rtol=1e-5, atol=1e-5)


# ---- fp8 cache in the engine ----


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_cache_generates_close_to_the_baseline(checkpoint, baseline, dtype):
    """Against the float cache of the model's dtype; in bf16 the kernel reads the fp8 values as bf16 ones
    where the CPU multiplies bf16."""
    options = dict(kv_cache_memory=4_000_000, block_size=4, dtype=dtype)
    if dtype != "float32":
        with LLM(checkpoint, **options) as llm:
            baseline = tokens_of(llm, PROMPTS)
    # Free-running greedy tokens diverge for good at the first flip (a random tiny model has flat logits),
    # so agreement is also measured step by step: each of the baseline's prefixes, one token each.
    prefixes = [p + out[:i] for p, out in zip(PROMPTS, baseline, strict=True) for i in range(len(out))]
    one = SamplingParams(temperature=0, max_tokens=1)
    with LLM(checkpoint, kv_cache_dtype="fp8", **options) as llm:
        assert llm.engine.cache.pool.dtype == torch.float8_e4m3fn
        tokens = tokens_of(llm, PROMPTS)
        steps = [o.outputs[0].token_ids[0] for o in llm.generate(prefixes, one)]
    free = agreement(tokens, baseline)
    step = sum(t == out[i] for t, (out, i) in zip(steps, _indexed(baseline), strict=True)) / len(steps)
    print(
        f"fp8 cache, tiny random model, {dtype}: greedy agreement {free:.3f} free-running, {step:.3f} a step"
    )
    assert step >= 0.8
    assert [t[:2] for t in tokens] == [t[:2] for t in baseline]


def _indexed(outputs: list[list[int]]) -> list[tuple[list[int], int]]:
    return [(out, i) for out in outputs for i in range(len(out))]


def test_fp8_cache_keeps_the_bundled_models_answers():
    problems = held_out_sample(200)
    conversations = [messages((p,)) for p in problems]
    params = SamplingParams(temperature=0, max_tokens=64)
    results = {}
    for dtype in ("auto", "fp8"):
        with LLM(str(REPO / "checkpoints/small"), kv_cache_memory=20_000_000, kv_cache_dtype=dtype) as llm:
            outs = llm.chat(conversations, params)
        results[dtype] = (
            [o.outputs[0].token_ids for o in outs],
            sum(is_correct(p, o.outputs[0].text) for p, o in zip(problems, outs, strict=True))
            / len(problems),
        )
    (base_tokens, base_acc), (fp8_tokens, fp8_acc) = results["auto"], results["fp8"]
    same = sum(a == b for a, b in zip(base_tokens, fp8_tokens, strict=True)) / len(problems)
    n = len(problems)
    print(f"bundled model, {n} problems: accuracy {base_acc:.3f} -> {fp8_acc:.3f} with the fp8 cache")
    print(f"bundled model, {n} problems: {same:.3f} of the answers token for token the same")
    # e4m3 rounding flips the answers the model is least sure of (0.84 the same, 0.655 -> 0.615 on the
    # shipped checkpoint); a broken fp8 path changes nearly all of them.
    assert same >= 0.75 and fp8_acc >= base_acc - 0.08


def test_fp8_cache_fits_about_twice_the_blocks_of_bf16(tmp_path):
    # DeepSeek-V3's latent shape (512 + 64): 1152 bytes per token and layer in bf16, 576 + 8 in fp8.
    path = make_hf_model(tmp_path / "wide", "v3", num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64)
    budget = 2_000_000
    blocks = {}
    for dtype, kv in (("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "auto")):
        with LLM(
            str(path), dtype=dtype, kv_cache_memory=budget, kv_cache_dtype=kv, skip_tokenizer_init=True
        ) as llm:
            blocks[dtype, kv] = llm.engine.blocks.num_blocks
    ratio = blocks["bfloat16", "fp8"] / blocks["bfloat16", "auto"]
    print(f"blocks for {budget} bytes: {blocks}; fp8 / bf16 = {ratio:.3f}")
    assert 1.9 < ratio < 2.0  # 1152 / 584
    assert blocks["bfloat16", "fp8"] / blocks["float32", "auto"] > 3.9  # the CPU default is fp32


def test_plan_counts_fp8_cache_bytes():
    from moelaunch.launcher.deploy.config import load_deploy_config
    from moelaunch.launcher.deploy.plan import build_plan

    example = REPO / "configs/examples/deepseek-v3-2x8-h200.yaml"
    sizes = [
        build_plan(load_deploy_config(example, [f"engine.kv_cache_dtype={kv}"])).heaviest.kv_cache_bytes
        for kv in ("auto", "fp8")
    ]
    assert sizes[1] / sizes[0] == pytest.approx(584 / 1152)


# ---- sliding window ----


def band_reference(model, ids: Tensor, window: int | None, monkeypatch) -> Tensor:
    """Logits of the model without a cache, its causal attention given an explicit band mask: a query at
    q sees keys q - window .. q."""
    sdpa = F.scaled_dot_product_attention

    def banded(q, k, v, *, is_causal: bool, scale: float):
        assert is_causal
        pos = torch.arange(q.shape[-2])
        band = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - window)
        return sdpa(q, k, v, attn_mask=band, scale=scale)

    with monkeypatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", banded)
        return model(ids)


def chunked_logits(model, ids: Tensor, cache: PagedLatentCache, cuts: list[int]) -> Tensor:
    """Logits from the cached path: chunks of prefill at `cuts`, then one token at a time."""
    bounds = [0, *cuts, *range(cuts[-1] + 1, ids.shape[1] + 1)]
    parts = [
        model(ids[:, a:b], start_pos=a, cache=cache) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(parts, dim=1)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


def test_a_window_longer_than_the_sequence_changes_nothing(model, checkpoint, baseline):
    ids = torch.tensor([PROMPTS[0]])
    plain = chunked_logits(model, ids, model.new_cache(1, 40), [10, 30])
    wide = model.new_paged_cache(1, 40, sparse=SparseAttention(window=40))
    assert torch.equal(chunked_logits(model, ids, wide, [10, 30]), plain)
    with LLM(checkpoint, kv_cache_memory=4_000_000, block_size=4, attention={"window": 64}) as llm:
        assert tokens_of(llm, PROMPTS) == baseline


@pytest.mark.parametrize("window", [1, 5, 8])
def test_a_window_equals_attention_under_a_band_mask(model, window, monkeypatch):
    ids = torch.tensor([PROMPTS[0]])
    expected = band_reference(model, ids, window, monkeypatch)
    cache = model.new_paged_cache(1, 40, sparse=SparseAttention(window=window))
    torch.testing.assert_close(chunked_logits(model, ids, cache, [10, 30]), expected, rtol=1e-4, atol=1e-4)
    fp8 = model.new_paged_cache(1, 40, fp8=True, sparse=SparseAttention(window=window))
    # With an fp8 cache as well: the fp8 rounding alone (mean |logit| here is about 0.6).
    assert (chunked_logits(model, ids, fp8, [10, 30]) - expected).abs().mean() < 0.05


def test_the_engine_with_a_window_generates_the_band_masked_models_tokens(checkpoint, model, monkeypatch):
    """Greedy tokens from the engine (paged blocks, chunked prefill, freed blocks) against greedy decoding
    that recomputes the band-masked reference from scratch at every step."""
    window = 8
    expected = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(GREEDY.max_tokens):
            logits = band_reference(model, torch.tensor([ids]), window, monkeypatch)
            ids.append(int(logits[0, -1].argmax()))
        expected.append(ids[len(prompt) :])
    options = dict(kv_cache_memory=4_000_000, block_size=4, attention={"window": window})
    with LLM(checkpoint, max_num_batched_tokens=7, **options) as llm:
        assert tokens_of(llm, PROMPTS) == expected


def test_blocks_behind_the_window_are_freed_and_prefix_hits_stay_right(checkpoint):
    window, size = 8, 4
    prompt = PROMPTS[0]  # 37 tokens
    with LLM(checkpoint, kv_cache_memory=4_000_000, block_size=size, attention={"window": window}) as llm:
        engine = llm.engine
        engine.add_request("a", prompt, GREEDY)
        most_held = 0
        while engine.has_unfinished():
            engine.step()
            held = engine.blocks.num_blocks - engine.blocks.num_free
            most_held = max(most_held, held)
            if engine.has_unfinished():
                # The next query at p sees p - 8 .. p: blocks from (p - 8) // 4 to p // 4.
                assert held <= (window + size - 1) // size + 2
        assert engine.blocks.num_free == engine.blocks.num_blocks
        first = engine.requests["a"].outputs[0].token_ids
        # The same prompt again: its first blocks were freed by the window but kept their hashes; a hit
        # on them must give the same tokens.
        hits = engine.blocks.stats.prefix_hit_tokens
        again = tokens_of(llm, [prompt])[0]
        assert engine.blocks.stats.prefix_hit_tokens > hits
    assert again == first
    options = dict(kv_cache_memory=4_000_000, block_size=size, attention={"window": window})
    with LLM(checkpoint, enable_prefix_caching=False, **options) as llm:
        assert tokens_of(llm, [prompt])[0] == first


# ---- sparse top-k blocks ----


def test_topk_covering_every_block_is_exactly_the_baseline(checkpoint, baseline):
    with LLM(checkpoint, kv_cache_memory=4_000_000, block_size=4, attention={"topk_blocks": 32}) as llm:
        assert tokens_of(llm, PROMPTS) == baseline


@pytest.mark.parametrize("fp8", [False, True])
def test_topk_decode_equals_attention_under_the_selected_blocks_mask(fp8):
    """The cache's top-k decode against plain attention over every cached token with a mask that keeps
    the K blocks whose mean latent scores best (best over heads) and the query's own block."""
    c_dim, p_dim, size, k, heads = 16, 8, 4, 2, 3
    args = latent_args(c_dim, p_dim)
    cache = PagedLatentCache(args, 16, size, fp8=fp8, sparse=SparseAttention(topk_blocks=k))
    g = torch.Generator().manual_seed(3)
    lens = [23, 6, 14]  # 5, 1 and 3 full blocks before the query's block
    perm = torch.randperm(16, generator=g)
    table = torch.zeros(3, 6, dtype=torch.long)  # past a row's blocks: 0, never read
    table[0], table[1, :2], table[2, :4] = perm[:6], perm[6:8], perm[8:12]
    seqs = []
    for r, n in enumerate(lens):
        latent = _latents(g, (n,), c_dim, p_dim) / 10
        pos = torch.arange(n)
        cache.store(0, table[r, pos // size] * size + pos % size, latent)
        seqs.append(torch.cat(cache.gather(0, table[r], n), dim=-1).float())  # as stored (fp8: rounded)
    q, q_pe = torch.randn(3, heads, c_dim, generator=g), torch.randn(3, heads, p_dim, generator=g)
    scale = 0.3
    out = cache.decode(0, q, q_pe, table, torch.tensor(lens), scale)
    expected = []
    for r, tokens in enumerate(seqs):
        n_full = (lens[r] - 1) // size
        means = tokens[: n_full * size].view(n_full, size, -1).mean(dim=1)
        block_scores = (q[r] @ means[:, :c_dim].T + q_pe[r] @ means[:, c_dim:].T).amax(dim=0)
        keep = set(block_scores.topk(min(k, n_full)).indices.tolist()) | {n_full}
        visible = torch.tensor([t // size in keep for t in range(lens[r])])
        scores = (q[r] @ tokens[:, :c_dim].T + q_pe[r] @ tokens[:, c_dim:].T) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        expected.append(probs @ tokens[:, :c_dim])
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-5, atol=1e-5)


def test_topk_prefill_selects_per_token_as_decode_does(checkpoint):
    """Prompt chunks under top-k: every token picks its own blocks, so a whole-prompt prefill gives the
    log-probabilities of feeding the prompt one token per step (each a decode query, checked against an
    explicit mask above); full attention gives others once a token has more than K full blocks behind."""
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    prompt = PROMPTS[0]  # 37 tokens: up to 9 full blocks of 4 behind a token

    def first_logprobs(**options) -> list[dict[int, float]]:
        with LLM(
            checkpoint, kv_cache_memory=4_000_000, block_size=4, enable_prefix_caching=False, **options
        ) as llm:
            return llm.generate([prompt], params)[0].outputs[0].logprobs

    topk = {"attention": {"topk_blocks": 2}}
    chunked = first_logprobs(**topk)
    token_by_token = first_logprobs(max_num_batched_tokens=1, **topk)
    full = first_logprobs()
    for ours, step in zip(chunked, token_by_token, strict=True):
        assert ours.keys() == step.keys() and max(abs(ours[t] - step[t]) for t in ours) < 1e-5
    assert max(abs(lp - full[0].get(t, 0.0)) for t, lp in chunked[0].items()) > 1e-3


def test_small_topk_generates_and_reports_agreement(checkpoint, baseline):
    with LLM(checkpoint, kv_cache_memory=4_000_000, block_size=4, attention={"topk_blocks": 2}) as llm:
        tokens = tokens_of(llm, PROMPTS)
    print(f"top-2 blocks of 4, tiny random model: greedy token agreement {agreement(tokens, baseline):.3f}")
    # The short prompt has at most 2 full blocks before its query's block until 13 tokens, so it starts
    # exactly as the baseline does.
    assert tokens[1][:4] == baseline[1][:4]


# ---- bad values ----


@pytest.mark.parametrize(
    ("options", "named"),
    [({"attention": {"window": 0}}, "attention.window"), ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
     ({"attention": {"topk_blocks": 0}}, "attention.topk_blocks"),
     ({"attention": {"window": 4, "topk_blocks": 2}}, "attention"),
     ({"attention": {"size": 4}}, "attention.size")],
)  # fmt: skip
def test_bad_values_get_one_clear_error_before_loading(tmp_path, options, named):
    with pytest.raises(ValueError, match=f"^{named}:") as info:
        LLM(str(tmp_path), **options)
    assert "\n" not in str(info.value)


def test_the_deployment_file_takes_the_same_options(tmp_path):
    from moelaunch.launcher.deploy.config import DeployConfigError, load_deploy_config

    path = tmp_path / "deploy.yaml"
    path.write_text("model: ckpt\nengine: {kv_cache_dtype: fp8, attention: {window: 512}}\n")
    engine = load_deploy_config(path).engine
    assert (engine.kv_cache_dtype, engine.attention.window, engine.attention.topk_blocks) == (
        "fp8",
        512,
        None,
    )
    with pytest.raises(DeployConfigError, match="engine.attention.window"):
        load_deploy_config(path, ["engine.attention.window=0"])


def test_model_args_of_a_checkpoint_size_the_cache(checkpoint):
    args = load_args(checkpoint)
    fp8 = PagedLatentCache.bytes_per_block(args, 2, 4, torch.float32, fp8=True)
    means = PagedLatentCache.bytes_per_block(args, 2, 4, torch.float32, sparse=SparseAttention(topk_blocks=2))
    assert fp8 == 4 * 2 * (16 + 8 + 8)
    assert means == 4 * 2 * (16 + 8) * 4 + 2 * (16 + 8) * 4  # top-k keeps one fp32 mean per block and layer


def _selection_case(rows: int):
    g = torch.Generator().manual_seed(11)
    args = latent_args(32, 8)
    cache = PagedLatentCache(args, 40, 4, [0], sparse=SparseAttention(topk_blocks=3))
    cache.store(0, torch.arange(40 * 4), _latents(g, (40 * 4,), 32, 8))
    tables = torch.stack([torch.randperm(40, generator=g)[:12] for _ in range(rows)])
    seq_lens = torch.randint(20, 48, (rows,), generator=g)
    q_latent, q_pe = torch.randn(rows, 4, 32, generator=g), torch.randn(rows, 4, 8, generator=g)
    return cache, q_latent, q_pe, tables, seq_lens


def _count_slices(monkeypatch, cache) -> list[int]:
    sizes = []
    scored = cache._scored_slices

    def counted(*a):
        for rows, scores in scored(*a):
            sizes.append(scores.shape[0])
            yield rows, scores

    monkeypatch.setattr(cache, "_scored_slices", counted)
    return sizes


def test_topk_selection_a_few_rows_at_a_time_equals_all_at_once(monkeypatch):
    """A long prompt's every token selects its blocks: the selection runs over bounded slices of rows
    (it once took 27 GB for one 8K step at 32K), with the rows' choices unchanged."""
    from moelaunch.model import kv_cache

    cache, q_latent, q_pe, tables, seq_lens = _selection_case(rows=9)
    whole = cache._select_blocks(0, q_latent, q_pe, tables, seq_lens, 3)
    monkeypatch.setattr(kv_cache, "SELECT_BYTES", 1)  # one row at a time
    slices = _count_slices(monkeypatch, cache)
    sliced = cache._select_blocks(0, q_latent, q_pe, tables, seq_lens, 3)
    assert slices == [1] * 9  # bounded: never every row's means at once
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced, strict=True))


def test_topk_rows_sharing_a_table_select_as_rows_with_their_own_copy(monkeypatch):
    """A prompt's tokens share their sequence's table: scored against its block means gathered once
    (one product per slice, no [rows, blocks] table copy), they choose what each row would choose with
    its own copy of the table, in slices that never cross from one table to the next."""
    from moelaunch.model import kv_cache

    cache, q_latent, q_pe, tables, _ = _selection_case(rows=9)
    runs = [4, 1, 4]
    shared = tables[[0, 4, 5]]
    seq_lens = torch.tensor([30, 31, 32, 33, 48, 21, 22, 23, 24])
    copies = shared.repeat_interleave(torch.tensor(runs), dim=0)
    own = cache._select_blocks(0, q_latent, q_pe, copies, seq_lens, 3)
    monkeypatch.setattr(kv_cache, "SELECT_BYTES", 3 * 11 * 4 * 4)  # three rows' scores at a time
    slices = _count_slices(monkeypatch, cache)
    by_run = cache._select_blocks(0, q_latent, q_pe, shared, seq_lens, 3, runs)
    assert slices == [3, 1, 1, 3, 1]
    assert all(torch.equal(a, b) for a, b in zip(own, by_run, strict=True))
