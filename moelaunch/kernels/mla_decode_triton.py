"""Triton paged MLA decode attention; same signature and numerics as `mla_decode_reference`.

Flash-decoding: one program per (query row, tile of heads, split of the sequence) walks its share of the
row's tokens (from the row's start, when a sliding window gives one) in tiles with an online softmax, fp32
statistics and accumulator. All heads share one latent key per token, so a program loads each token's
[c | k_pe] once for all of its heads: wide head tiles (64 of V3's 128 heads, as FlashMLA does) read the
cache fewest times. With several splits each writes its normalized partial output and log-sum-exp, and a
second small kernel combines them; with one split the first kernel writes the output itself.

The number of splits depends only on static shapes (rows, heads, the block table's width) and the SM
count, never on lengths read back from the device, so a CUDA graph captures one launch for every step of
its bucket; each row's own length is divided between the splits on the device, and a split with no tokens
(a short row) contributes nothing (log-sum-exp -inf).

Under the Triton interpreter (TRITON_INTERPRET=1) float->bf16 casts truncate (triton issue 8322), so there
the dots run in fp32 and the kernel writes fp32 that torch casts; on a GPU 16-bit caches go through the
tensor cores with the probabilities cast to the cache dtype, as flash attention does. An fp8 cache
(`kv_fp8`) is read as stored and its per-token scales applied to the scores and probabilities.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moelaunch.kernels.triton_interpreter import interpreting, sm_count

# Heads per program: at least 16 (tl.dot's minimum tile side on a GPU; fewer heads are masked), at most 64
# for 16-bit and fp8 caches (a [64, 512] fp32 accumulator and bf16 query fill 8 warps' registers), 32 for
# fp32 caches (their fp32 query tile is twice as large).
MIN_HEADS_PER_PROGRAM = 16
MAX_HEADS_PER_PROGRAM = {2: 64, 4: 32}
# Tokens per tile of the online softmax: a tile may span several cache blocks or part of one.
TOKENS_PER_TILE = 32
# A split below this many tokens costs more in its partial output and the combine than it saves.
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 64


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """a @ b with fp32 accumulation; IEEE fp32 inputs when FP32 (no tf32), else b's 16-bit dtype."""
    if FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(b.dtype), b)
    return out


@triton.jit
def _paged_mla_decode_kernel(
    q_ptr,
    q_pe_ptr,
    cache_ptr,
    scales_ptr,
    table_ptr,
    lens_ptr,
    starts_ptr,
    out_ptr,
    lse_ptr,
    scale,
    H,
    stride_block,
    stride_slot,
    stride_scale_block,
    stride_table,
    C: tl.constexpr,
    P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    CACHE_FP8: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    cs = tl.arange(0, BLOCK_C)
    ps = tl.arange(0, BLOCK_P)
    head_ok = heads < H
    c_ok = cs < C
    p_ok = ps < P
    # q_latent, q_pe and out are contiguous [R, H, *]; padded heads and columns read as zeros.
    qh = row * H + heads
    q = tl.load(q_ptr + qh[:, None] * C + cs[None, :], mask=head_ok[:, None] & c_ok[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + qh[:, None] * P + ps[None, :], mask=head_ok[:, None] & p_ok[None, :], other=0.0)

    seq_len = tl.load(lens_ptr + row)
    first = tl.load(starts_ptr + row) if HAS_STARTS else 0
    # This split's share of the row: whole tiles, so only the row's last tile is partial; trailing splits
    # of a short row get none (lo >= hi) and leave m_i = -inf, l_i = 0.
    share = tl.cdiv(tl.cdiv(seq_len - first, SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * share
    hi = tl.minimum(lo + share, seq_len)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        tok_ok = pos < hi
        # Each token finds its block through the table; tokens past the end (partial last tile) load
        # nothing, so their block ids (-1, stale) and slots (uninitialized) are never touched.
        block = tl.load(table_ptr + row * stride_table + pos // BLOCK_SIZE, mask=tok_ok, other=0)
        tok = cache_ptr + block.to(tl.int64) * stride_block + (pos % BLOCK_SIZE) * stride_slot
        c = tl.load(tok[:, None] + cs[None, :], mask=tok_ok[:, None] & c_ok[None, :], other=0.0)
        k_pe = tl.load(tok[:, None] + C + ps[None, :], mask=tok_ok[:, None] & p_ok[None, :], other=0.0)
        if CACHE_FP8:
            # e4m3 values are exact in bf16, so the dots run on them as stored and each token's scales
            # (one for c, one for k_pe) multiply its scores and its probability instead.
            c = c.to(tl.float32 if FP32_DOT else tl.bfloat16)
            k_pe = k_pe.to(c.dtype)
            sc_ptr = scales_ptr + block.to(tl.int64) * stride_scale_block + (pos % BLOCK_SIZE) * 2
            c_scale = tl.load(sc_ptr, mask=tok_ok, other=0.0)
            pe_scale = tl.load(sc_ptr + 1, mask=tok_ok, other=0.0)
            s = _dot(q, tl.trans(c), FP32_DOT) * c_scale[None, :]
            s += _dot(q_pe, tl.trans(k_pe), FP32_DOT) * pe_scale[None, :]
        else:
            s = _dot(q, tl.trans(c), FP32_DOT) + _dot(q_pe, tl.trans(k_pe), FP32_DOT)
        s = tl.where(tok_ok[None, :], s * scale, float("-inf"))
        # Online softmax: rescale what was summed so far to the new running max. Every tile holds at least
        # one real token (start < hi), so m_new is finite and no -inf - -inf appears.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if CACHE_FP8:
            p_v = p * c_scale[None, :]
        else:
            p_v = p
        acc = acc * alpha[:, None] + _dot(p_v, c, FP32_DOT)
        m_i = m_new

    out_mask = head_ok[:, None] & c_ok[None, :]
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + qh[:, None] * C + cs[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials [R, H, SPLITS, C] fp32 and log-sum-exps [R, H, SPLITS]; an empty split writes 0 and -inf.
        has = l_i > 0
        l_safe = tl.where(has, l_i, 1.0)
        out = acc / l_safe[:, None]
        part = qh * SPLITS + split
        tl.store(out_ptr + part[:, None] * C + cs[None, :], out, mask=out_mask)
        tl.store(lse_ptr + part, tl.where(has, m_i + tl.log(l_safe), float("-inf")), mask=head_ok)


@triton.jit
def _combine_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    C: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program per (row, head): out = sum_s exp(lse_s - lse) * part_s, lse = logsumexp_s lse_s."""
    qh = tl.program_id(0)
    ss = tl.arange(0, BLOCK_S)
    cs = tl.arange(0, BLOCK_C)
    lses = lse_ptr + qh * SPLITS
    # The first split always holds the row's first token, so the max is finite; empty splits weigh 0.
    lse = tl.load(lses + ss, mask=ss < SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    total = tl.sum(tl.exp(lse - top), axis=0)
    # One split's row at a time: a [SPLITS, C] tile would not fit in registers at 64 splits.
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for split in range(SPLITS):
        part = tl.load(part_ptr + (qh * SPLITS + split) * C + cs, mask=cs < C, other=0.0)
        acc += tl.exp(tl.load(lses + split) - top) * part
    out = acc / total
    tl.store(out_ptr + qh * C + cs, out.to(out_ptr.dtype.element_ty), mask=cs < C)


def _tile(n: int) -> int:
    """Power-of-two tile side covering n, at least 16 (tl.dot's minimum on a GPU)."""
    return max(16, triton.next_power_of_2(n))


def heads_per_program(heads: int, cache_dtype: torch.dtype) -> int:
    """The head tile: every head of a row in one program up to the register limit for the cache's dtype."""
    most = MAX_HEADS_PER_PROGRAM[min(4, max(2, cache_dtype.itemsize))]
    return min(most, max(MIN_HEADS_PER_PROGRAM, triton.next_power_of_2(heads)))


def num_splits(rows: int, head_tiles: int, max_tokens: int, sms: int) -> int:
    """Splits of the sequence per (row, head tile) from static shapes only: as many as fill one wave over
    the SMs without starting a second, partial one, and none shorter than MIN_TOKENS_PER_SPLIT of what the
    block table can hold."""
    return max(1, min(sms // (rows * head_tiles), max_tokens // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


def paged_mla_decode_triton(
    q_latent: Tensor,
    q_pe: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    cache_scales: Tensor | None = None,
    starts: Tensor | None = None,
) -> Tensor:
    r, h, _ = q_latent.shape
    tile = heads_per_program(h, cache.dtype)
    max_tokens = block_table.shape[1] * cache.shape[1]
    splits = num_splits(r, triton.cdiv(h, tile), max_tokens, sm_count(q_latent.device))
    return paged_mla_decode_split(
        q_latent, q_pe, cache, block_table, seq_lens, scale, cache_scales, starts, heads=tile, splits=splits
    )


def paged_mla_decode_split(
    q_latent: Tensor,
    q_pe: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    cache_scales: Tensor | None = None,
    starts: Tensor | None = None,
    *,
    heads: int,
    splits: int,
) -> Tensor:
    """`paged_mla_decode_triton` with a given head tile (a power of two >= 16) and number of splits."""
    r, h, c_dim = q_latent.shape
    p_dim = q_pe.shape[-1]
    assert cache.shape[-1] == c_dim + p_dim, f"cache rows {cache.shape[-1]} != C + P = {c_dim + p_dim}"
    # The cache is large and paged in place: index it through its strides instead of copying it.
    assert cache.stride(-1) == 1, "cache's last dim must be contiguous"
    fp8 = cache_scales is not None
    if fp8:
        assert cache_scales.stride(1) == 2 and cache_scales.stride(2) == 1, "scales: [blocks, slots, 2]"
    interpreted = interpreting()
    out_dtype = torch.float32 if interpreted else q_latent.dtype
    out = torch.empty(r, h, c_dim, dtype=out_dtype, device=q_latent.device)
    if splits > 1:
        partial = torch.empty(r, h, splits, c_dim, dtype=torch.float32, device=q_latent.device)
        lse = torch.empty(r, h, splits, dtype=torch.float32, device=q_latent.device)
    else:
        partial, lse = out, out  # the kernel writes the output itself and no log-sum-exp
    table = block_table.contiguous()
    lens = seq_lens.contiguous()
    _paged_mla_decode_kernel[(r, triton.cdiv(h, heads), splits)](
        q_latent.contiguous(),
        q_pe.contiguous(),
        cache,
        cache_scales if fp8 else cache,  # never read without CACHE_FP8
        table,
        lens,
        starts.contiguous() if starts is not None else lens,  # never read without HAS_STARTS
        partial,
        lse,
        scale,
        h,
        cache.stride(0),
        cache.stride(1),
        cache_scales.stride(0) if fp8 else 0,
        table.stride(0),
        C=c_dim,
        P=p_dim,
        BLOCK_SIZE=cache.shape[1],
        BLOCK_H=heads,
        BLOCK_C=_tile(c_dim),
        BLOCK_P=_tile(p_dim),
        BLOCK_N=TOKENS_PER_TILE,
        FP32_DOT=interpreted or cache.dtype == torch.float32,
        CACHE_FP8=fp8,
        HAS_STARTS=starts is not None,
        SPLITS=splits,
        num_warps=8 if heads >= 64 else 4,
    )
    if splits > 1:
        _combine_splits_kernel[(r * h,)](
            partial,
            lse,
            out,
            C=c_dim,
            SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_C=_tile(c_dim),
        )
    return out.to(q_latent.dtype)
