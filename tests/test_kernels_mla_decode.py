"""Paged MLA decode: Triton (interpreted on CPU tensors) against the torch reference, the reference and the
CPU C++ kernel against a plain per-row loop over contiguous sequences, and the absorbed form against
naive MLA."""

from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
from error_bounds import assert_within, dot_logit_error, matmul_error, softmax_average_error
from torch import Tensor

from moelaunch import kernels
from moelaunch.kernels import mla_decode_cpu as cpu
from moelaunch.kernels import mla_decode_reference as ref
from moelaunch.kernels.selection import CPU_ISA_PATHS, cpu_isa_path
from moelaunch.kernels.triton_interpreter import INTERPRETER_SMS

# bf16's unit roundoff (8 significant bits, round to nearest).
U_BF16 = 2.0**-8

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels run on CPU tensors only when interpreted",
)


@pytest.fixture(scope="module")
def tri() -> ModuleType:
    from moelaunch.kernels import mla_decode_triton

    return mla_decode_triton


@pytest.fixture(params=["reference", "cpu", "triton"])
def path(request, monkeypatch) -> str:
    """Which implementation `kernels.paged_mla_decode` runs, chosen the way a user would (env vars)."""
    monkeypatch.delenv("MOELAUNCH_TRITON_ON_CPU", raising=False)
    monkeypatch.delenv("MOELAUNCH_CPU_KERNELS", raising=False)
    if request.param == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels run on CPU tensors only when interpreted")
        monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    elif request.param == "reference":
        monkeypatch.setenv("MOELAUNCH_CPU_KERNELS", "0")
    else:
        assert kernels.prepare_cpu_kernels(), "the C++ kernels must build here (g++ and ninja are installed)"
    return request.param


@dataclass
class PagedBatch:
    q_latent: Tensor  # [R, H, C]
    q_pe: Tensor  # [R, H, P]
    cache: Tensor  # [num_blocks, block_size, C + P]
    block_table: Tensor  # [R, max_blocks] int32
    seq_lens: Tensor  # [R] int32
    seqs: list[Tensor]  # the tokens [L, C + P] of each sequence, contiguous: what the cache pages hold
    row_seq: list[int]  # which sequence each query row reads

    def args(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self.q_latent, self.q_pe, self.cache, self.block_table, self.seq_lens


def _paged_batch(
    g: torch.Generator,
    heads: int,
    c_dim: int,
    p_dim: int,
    block_size: int,
    seq_lens: list[int],
    row_seq: list[int],
    dtype: torch.dtype = torch.float32,
) -> PagedBatch:
    """Sequences paged into shuffled blocks; rows that share a sequence share its block-table row.

    Every slot no sequence owns (tails of last blocks, spare blocks) is NaN, so reading one poisons the
    output. Table entries past a sequence's blocks are -1, an id past num_blocks, or a spare block's id.
    """
    lengths = [
        max(n for n, s in zip(seq_lens, row_seq, strict=True) if s == i) for i in range(max(row_seq) + 1)
    ]
    seqs = [torch.randn(n, c_dim + p_dim, generator=g).to(dtype) for n in lengths]
    owned = [-(-n // block_size) for n in lengths]
    num_blocks = sum(owned) + 2
    ids = torch.randperm(num_blocks, generator=g).tolist()
    pads = [-1, num_blocks + 100, ids[-1]]
    max_blocks = max(owned) + 1
    cache = torch.full((num_blocks, block_size, c_dim + p_dim), float("nan"), dtype=dtype)
    table = torch.empty(len(seqs), max_blocks, dtype=torch.int32)
    for i, (seq, k) in enumerate(zip(seqs, owned, strict=True)):
        own, ids = ids[:k], ids[k:]
        table[i] = torch.tensor(own + [pads[i % len(pads)]] * (max_blocks - k))
        for j, block in enumerate(own):
            chunk = seq[j * block_size : (j + 1) * block_size]
            cache[block, : len(chunk)] = chunk
    rows = len(seq_lens)
    return PagedBatch(
        q_latent=torch.randn(rows, heads, c_dim, generator=g).to(dtype),
        q_pe=torch.randn(rows, heads, p_dim, generator=g).to(dtype),
        cache=cache,
        block_table=table[row_seq],
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seqs=seqs,
        row_seq=row_seq,
    )


def _lens_and_sharing(block_size: int) -> tuple[list[int], list[int]]:
    """Lengths 1, exactly a block, ragged, exactly a Triton tile, and over two tiles; rows 0-1 and 4-5 share
    a sequence (4-5 as speculative verification does: lengths n and n + 1)."""
    return [1, block_size, 2 * block_size + 3, 32, 69, 70], [0, 0, 1, 2, 3, 3]


def _attended(b: PagedBatch, starts: list[int] | None) -> list[tuple[int, Tensor]]:
    """(row, its tokens [start, length) as stored) for every row."""
    firsts = starts or [0] * len(b.row_seq)
    return [
        (r, b.seqs[s][first:n])
        for r, (n, s, first) in enumerate(zip(b.seq_lens.tolist(), b.row_seq, firsts, strict=True))
    ]


def _naive_decode(b: PagedBatch, scale: float, starts: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """Per row and head, softmax over the row's contiguous tokens (from its start, default 0) in float64,
    and the bound on an fp32 computation's error (tests/error_bounds.py): ([R, H, C], [R, H, C])."""
    rows, heads, c_dim = b.q_latent.shape
    out = torch.empty(rows, heads, c_dim, dtype=torch.float64)
    bound = torch.empty_like(out)
    for r, tokens in _attended(b, starts):
        tokens = tokens.float()
        queries = torch.cat([b.q_latent[r], b.q_pe[r]], dim=-1).float()  # [H, C + P]
        logits = scale * (queries.double() @ tokens.double().T)
        c = tokens[:, :c_dim].double()
        out[r] = logits.softmax(dim=-1) @ c
        bound[r] = softmax_average_error(logits, dot_logit_error(queries, tokens, scale), c)
    return out, bound


def weighted_spread(b: PagedBatch, scale: float, exact: Tensor, starts: list[int] | None = None) -> Tensor:
    """sum_t w_t |v_t - out| per row, head and column: how far rounding each softmax weight w_t to bf16
    (the C++ kernel's AVX512-BF16 and AMX paths) can move the average, in units of the relative rounding
    error."""
    spread = torch.empty_like(exact)
    c_dim = exact.shape[-1]
    for r, tokens in _attended(b, starts):
        tokens = tokens.double()
        queries = torch.cat([b.q_latent[r], b.q_pe[r]], dim=-1).double()
        weights = (scale * queries @ tokens.T).softmax(dim=-1)  # [H, n]
        values = tokens[:, :c_dim]
        spread[r] = torch.einsum("ht,htc->hc", weights, (values[None] - exact[r][:, None]).abs())
    return spread


def _check_decode(out: Tensor, b: PagedBatch, scale: float) -> None:
    assert_within(out, *_naive_decode(b, scale))


# Logits in the hundreds: exp overflows without the running max, and the max moves between tiles.
LARGE_LOGITS_SCALE = 20.0


def _large_logits_batch() -> PagedBatch:
    return _paged_batch(torch.Generator().manual_seed(3), 4, 64, 16, 4, *_lens_and_sharing(4))


def tri_module_file() -> str:
    from moelaunch.kernels import mla_decode_triton

    return mla_decode_triton.__file__


@needs_interpreter
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("p_dim", [8, 16])
@pytest.mark.parametrize("c_dim", [16, 64])
@pytest.mark.parametrize("heads", [1, 4, 16])
def test_triton_matches_reference(tri, heads, c_dim, p_dim, block_size):
    g = torch.Generator().manual_seed(heads * 1000 + c_dim * 10 + p_dim + block_size)
    b = _paged_batch(g, heads, c_dim, p_dim, block_size, *_lens_and_sharing(block_size))
    scale = (c_dim + p_dim) ** -0.5
    out = tri.paged_mla_decode_triton(*b.args(), scale)
    assert out.shape == (6, heads, c_dim) and out.dtype == torch.float32
    _check_decode(out, b, scale)


@needs_interpreter
def test_triton_strided_inputs_and_head_blocks(tri):
    """A cache view with padded rows (only the last dim contiguous), a transposed q_latent, int64 lengths,
    and 20 heads in tiles of 16: two head tiles per row, the second partial."""
    g = torch.Generator().manual_seed(7)
    b = _paged_batch(g, 20, 64, 16, 16, *_lens_and_sharing(16))
    padded = torch.randn(*b.cache.shape[:-1], 80 + 8, generator=g)
    padded[..., :80] = b.cache
    q_latent = b.q_latent.transpose(0, 1).contiguous().transpose(0, 1)
    args = (q_latent, b.q_pe, padded[..., :80], b.block_table, b.seq_lens.long(), 0.125)
    _check_decode(tri.paged_mla_decode_split(*args, heads=16, splits=1), b, 0.125)
    _check_decode(tri.paged_mla_decode_triton(*args), b, 0.125)  # one tile of 32


# --- split-KV: the sequence split over programs, then combined ----------------------------------------


def _split_batch(heads: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> PagedBatch:
    """Uneven lengths in blocks of 16: 1 token, less than a tile, and rows long enough for several splits;
    the table holds 320 tokens, so most splits of the short rows are empty."""
    lens, row_seq = [1, 7, 150, 300, 33], [0, 1, 2, 3, 4]
    return _paged_batch(torch.Generator().manual_seed(seed), heads, 64, 16, 16, lens, row_seq, dtype)


@needs_interpreter
@pytest.mark.parametrize(("heads", "tile", "splits"), [(128, 64, 2), (128, 64, 8), (20, 16, 3)])
def test_split_kv_matches_naive_loop(tri, heads, tile, splits):
    """Several splits, each row's tokens divided between them; unowned slots are NaN, so a split that
    read past its row's range would poison the output."""
    b = _split_batch(heads, seed=splits)
    out = tri.paged_mla_decode_split(*b.args(), 0.125, heads=tile, splits=splits)
    _check_decode(out, b, 0.125)


@needs_interpreter
def test_split_kv_large_logits(tri):
    """Logits in the hundreds: the combine must weigh each split by exp(lse - max), not exp(lse)."""
    b = _split_batch(4, seed=9)
    out = tri.paged_mla_decode_split(*b.args(), LARGE_LOGITS_SCALE, heads=16, splits=5)
    _check_decode(out, b, LARGE_LOGITS_SCALE)


@needs_interpreter
def test_split_kv_bf16_128_heads(tri):
    b = _split_batch(128, torch.bfloat16, seed=4)
    out = tri.paged_mla_decode_split(*b.args(), 0.125, heads=64, splits=4)
    assert out.dtype == torch.bfloat16
    expected, bound = _naive_decode(b, 0.125)
    assert_within(out, expected, bound + 2**-8 * (expected.abs() + bound))


@needs_interpreter
@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
def test_split_kv_fp8_cache_and_window(tri, window):
    """An fp8 cache with per-token scales, and window starts (the blocks before a start freed, -1): the
    splits divide only [start, length), against the reference on the same stored cache."""
    from moelaunch.kernels.kv_fp8 import quantize_latent

    b = _split_batch(128, seed=5)
    values, scales = quantize_latent(b.cache.nan_to_num(0.0), 64)
    starts = torch.tensor([0, 3, 100, 250, 1]) if window else None
    table = b.block_table.clone()
    if window:
        table[2, : 100 // 16] = -1
        table[3, : 250 // 16] = -1
    args = (b.q_latent, b.q_pe, values, table, b.seq_lens, 0.125, scales, starts)
    out = tri.paged_mla_decode_split(*args, heads=64, splits=8 if window else 3)
    torch.testing.assert_close(out, ref.paged_mla_decode_ref(*args), rtol=1e-5, atol=1e-5)


def test_split_count_depends_only_on_static_shapes(tri):
    # At most one wave over 132 SMs: batch 1 x 2 head tiles wants 66 splits, capped at 128 tokens a split.
    assert tri.num_splits(rows=1, head_tiles=2, max_tokens=4096, sms=132) == 32
    assert tri.num_splits(rows=1, head_tiles=4, max_tokens=1 << 20, sms=132) == 33
    assert tri.num_splits(rows=1, head_tiles=1, max_tokens=1 << 20, sms=132) == tri.MAX_SPLITS
    assert tri.num_splits(rows=8, head_tiles=2, max_tokens=4096, sms=132) == 8  # never a partial 2nd wave
    # Enough programs to fill the SMs, or a table too short to split: one split, no combine.
    assert tri.num_splits(rows=64, head_tiles=2, max_tokens=4096, sms=132) == 1
    assert tri.num_splits(rows=1, head_tiles=2, max_tokens=200, sms=132) == 1
    assert tri.heads_per_program(128, torch.bfloat16) == 64
    assert tri.heads_per_program(128, torch.float8_e4m3fn) == 64
    assert tri.heads_per_program(128, torch.float32) == 32
    assert tri.heads_per_program(4, torch.bfloat16) == 16


@needs_interpreter
def test_decode_entry_splits_a_short_batch(tri, monkeypatch):
    """The user path (kernels.paged_mla_decode with Triton on CPU tensors) picks several splits for a
    two-row batch over a 320-token table, and matches the naive loop."""
    monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    launched: list[int] = []
    split = tri.paged_mla_decode_split
    monkeypatch.setattr(
        tri,
        "paged_mla_decode_split",
        lambda *a, heads, splits: launched.append(splits) or split(*a, heads=heads, splits=splits),
    )
    b = _paged_batch(torch.Generator().manual_seed(8), 16, 64, 16, 16, [300, 41], [0, 1])
    _check_decode(kernels.paged_mla_decode(*b.args(), 0.125), b, 0.125)
    assert (
        launched == [tri.num_splits(2, 1, b.block_table.shape[1] * 16, INTERPRETER_SMS)] and launched[0] > 1
    )


@needs_interpreter
def test_triton_large_logits(tri):
    """Logits in the hundreds overflow exp without the running max: checks the online rescaling."""
    b = _large_logits_batch()
    _check_decode(tri.paged_mla_decode_triton(*b.args(), LARGE_LOGITS_SCALE), b, LARGE_LOGITS_SCALE)


@needs_interpreter
@pytest.mark.parametrize(
    "broken",
    ["acc = acc * alpha[:, None] + ", "l_i = l_i * alpha + "],
    ids=["accumulator", "denominator"],
)
def test_large_logits_check_catches_a_broken_rescaling(tmp_path, monkeypatch, broken):
    """The bound is loose enough for any summation order and still far below a real bug: the kernel with
    one of its online-softmax rescalings dropped fails the check of test_triton_large_logits."""
    source = Path(tri_module_file()).read_text()
    mutated = {
        "acc = acc * alpha[:, None] + ": "acc = acc + ",
        "l_i = l_i * alpha + ": "l_i = l_i + ",
    }[broken]
    assert source.count(broken) == 1, f"the kernel no longer has {broken!r}: update this test"
    (tmp_path / "broken_mla_decode.py").write_text(source.replace(broken, mutated))
    monkeypatch.syspath_prepend(str(tmp_path))
    broken_kernel = importlib.import_module("broken_mla_decode")
    b = _large_logits_batch()
    with pytest.raises(AssertionError, match="outside the error bound"):
        _check_decode(
            broken_kernel.paged_mla_decode_triton(*b.args(), LARGE_LOGITS_SCALE), b, LARGE_LOGITS_SCALE
        )
    sys.modules.pop("broken_mla_decode")


@pytest.mark.parametrize(
    ("heads", "c_dim", "p_dim", "block_size", "scale"),
    # 20 heads: two head groups in the C++ kernel, the second partial; scale 20: logits in the hundreds,
    # which overflow exp without the running max; c_dim 40 + 8: tails of a 16-lane vector in both products,
    # a weighted-sum chunk of 64 columns in 80 + 16.
    [
        (4, 64, 16, 4, 0.3),
        (1, 16, 8, 16, 0.3),
        (20, 64, 16, 16, 0.125),
        (4, 64, 16, 4, 20.0),
        (4, 40, 8, 16, 0.3),
        (5, 80, 16, 4, 0.3),
    ],
)
def test_cpu_paths_match_naive_loop(isa_path, heads, c_dim, p_dim, block_size, scale):
    """fp32 queries and cache on each instruction-set path (the 16-lane widening kernel from avx512 on)."""
    g = torch.Generator().manual_seed(block_size + heads)
    b = _paged_batch(g, heads, c_dim, p_dim, block_size, *_lens_and_sharing(block_size))
    for fn in (ref.paged_mla_decode_ref, cpu.paged_mla_decode_cpu):
        out = fn(*b.args(), scale)
        assert out.dtype == torch.float32
        _check_decode(out, b, scale)


def test_widening_reads_a_bf16_cache(isa_path):
    """fp32 queries over a bf16 cache: widened where the path has no bf16 dot products (scalar to avx512);
    the vdpbf16ps and AMX paths round the queries (bf16 values here, so exactly) and each softmax weight."""
    g = torch.Generator().manual_seed(5)
    b = _paged_batch(g, 4, 40, 8, 16, *_lens_and_sharing(16), dtype=torch.bfloat16)
    b.q_latent, b.q_pe = b.q_latent.float(), b.q_pe.float()
    out = cpu.paged_mla_decode_cpu(*b.args(), 0.3)
    assert out.dtype == torch.float32
    expected, bound = _naive_decode(b, 0.3)
    if CPU_ISA_PATHS.index(isa_path) >= CPU_ISA_PATHS.index("avx512_bf16"):
        bound = bound + U_BF16 * weighted_spread(b, 0.3, expected)
    assert_within(out, expected, bound)


def test_bf16_matches_naive_loop(path):
    """bf16 in and out, fp32 sums inside: the fp32 bound plus the final rounding to bf16 (2^-9 relative to
    nearest, 2^-8 where a cast truncates); on the C++ kernel's AVX512-BF16 and AMX paths also the rounding of
    each softmax weight to bf16 (tests/test_kernels_bf16_dot.py)."""
    g = torch.Generator().manual_seed(11)
    b = _paged_batch(g, 4, 64, 16, 16, *_lens_and_sharing(16), dtype=torch.bfloat16)
    out = kernels.paged_mla_decode(*b.args(), 0.125)
    assert out.dtype == torch.bfloat16
    expected, bound = _naive_decode(b, 0.125)
    if path == "cpu" and cpu_isa_path() >= CPU_ISA_PATHS.index("avx512_bf16"):
        bound = bound + U_BF16 * weighted_spread(b, 0.125, expected)
    assert_within(out, expected, bound + U_BF16 * (expected.abs() + bound))


def test_absorbed_decode_equals_naive_mla(path):
    """W_UK folded into the query and W_UV applied to the latent output give ordinary attention over the
    per-head keys [k_nope; k_pe] and values that kv_b expands from the latent."""
    heads, c_dim, p_dim, nope, v_dim, block_size = 4, 64, 16, 32, 24, 4
    seq_lens, row_seq = _lens_and_sharing(block_size)
    g = torch.Generator().manual_seed(5)
    b = _paged_batch(g, heads, c_dim, p_dim, block_size, seq_lens, row_seq)
    kv_b = torch.randn(heads * (nope + v_dim), c_dim, generator=g) / math.sqrt(c_dim)
    q_nope = torch.randn(len(seq_lens), heads, nope, generator=g)
    scale = (nope + p_dim) ** -0.5

    w = kv_b.view(heads, nope + v_dim, c_dim)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_latent = torch.einsum("rhd,hdc->rhc", q_nope, w_uk)
    out_latent = kernels.paged_mla_decode(q_latent, b.q_pe, b.cache, b.block_table, b.seq_lens, scale)
    absorbed = torch.einsum("rhc,hvc->rhv", out_latent, w_uv)

    for r, (n, s) in enumerate(zip(seq_lens, row_seq, strict=True)):
        c, k_pe = b.seqs[s][:n].double().split([c_dim, p_dim], dim=-1)
        k_nope, v = (c @ kv_b.double().T).view(n, heads, nope + v_dim).split([nope, v_dim], dim=-1)
        logits = torch.einsum("hd,shd->hs", q_nope[r].double(), k_nope) + b.q_pe[r].double() @ k_pe.T
        naive = torch.einsum("hs,shv->hv", (scale * logits).softmax(dim=-1), v)
        assert_within(absorbed[r], naive, _absorbed_error(q_nope[r], w_uk, w_uv, b.q_pe[r], c, k_pe, scale))


def _absorbed_error(
    q_nope: Tensor, w_uk: Tensor, w_uv: Tensor, q_pe: Tensor, c: Tensor, k_pe: Tensor, scale: float
) -> Tensor:
    """Bound on the fp32 error of the absorbed form for one row [H, V]: the folded query's rounding
    carried into the logits, the decode itself, and the rounding of the W_UV product."""
    heads = q_nope.shape[0]
    q_latent = torch.einsum("hd,hdc->hc", q_nope.double(), w_uk.double())
    q_latent_error = torch.stack([matmul_error(q_nope[h], w_uk[h]) for h in range(heads)])  # [H, C]
    queries = torch.cat([q_latent, q_pe.double()], dim=-1)
    keys = torch.cat([c, k_pe], dim=-1)
    logits = scale * (queries @ keys.T)
    logit_error = scale * (q_latent_error @ c.abs().T) + dot_logit_error(queries.float(), keys.float(), scale)
    out_latent = logits.softmax(dim=-1) @ c  # [H, C]
    latent_error = softmax_average_error(logits, logit_error, c)
    w_uv = w_uv.double().abs()
    return torch.stack(
        [w_uv[h] @ latent_error[h] + matmul_error(out_latent[h], w_uv[h].T) for h in range(heads)]
    )


@pytest.mark.parametrize(
    ("triton_on_cpu", "interpret", "cpu_kernels", "expected"),
    [
        (None, "1", None, "paged_mla_decode_cpu"),
        ("1", None, None, "paged_mla_decode_cpu"),
        ("0", "1", None, "paged_mla_decode_cpu"),
        (None, None, "0", "paged_mla_decode_ref"),
        pytest.param("1", "1", None, "paged_mla_decode_triton", marks=needs_interpreter),
    ],
    ids=["default", "no-interp", "off", "reference", "on"],
)
def test_dispatch_by_device_and_env(monkeypatch, tri, triton_on_cpu, interpret, cpu_kernels, expected):
    env = [("MOELAUNCH_TRITON_ON_CPU", triton_on_cpu), ("TRITON_INTERPRET", interpret)]
    for var, value in [*env, ("MOELAUNCH_CPU_KERNELS", cpu_kernels)]:
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    calls: list[str] = []
    targets = [(tri, "paged_mla_decode_triton"), (ref, "paged_mla_decode_ref"), (cpu, "paged_mla_decode_cpu")]
    for module, name in targets:
        monkeypatch.setattr(module, name, lambda *args, _name=name: calls.append(_name))
    b = _paged_batch(torch.Generator().manual_seed(0), 1, 16, 8, 4, [3], [0])
    kernels.paged_mla_decode(*b.args(), 1.0)
    assert calls == [expected]
