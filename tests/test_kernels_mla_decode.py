"""Paged MLA decode: Triton (interpreted on CPU tensors) against the torch reference, the reference and the
CPU C++ kernel against a plain per-row loop over contiguous sequences, and the absorbed form against
naive MLA."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from torch import Tensor

import kernels
from kernels import mla_decode_cpu as cpu
from kernels import mla_decode_reference as ref

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels run on CPU tensors only when interpreted",
)


@pytest.fixture(scope="module")
def tri() -> ModuleType:
    from kernels import mla_decode_triton

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


def _naive_decode(b: PagedBatch, scale: float) -> Tensor:
    """Per row and head, softmax over the row's contiguous prefix, in float64: [R, H, C]."""
    rows, heads, c_dim = b.q_latent.shape
    out = torch.empty(rows, heads, c_dim, dtype=torch.float64)
    for r, (n, s) in enumerate(zip(b.seq_lens.tolist(), b.row_seq, strict=True)):
        tokens = b.seqs[s][:n].double()
        c, k_pe = tokens[:, :c_dim], tokens[:, c_dim:]
        for h in range(heads):
            logits = scale * (c @ b.q_latent[r, h].double() + k_pe @ b.q_pe[r, h].double())
            weights = torch.exp(logits - logits.max())
            out[r, h] = (weights / weights.sum()) @ c
    return out


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
    torch.testing.assert_close(out, ref.paged_mla_decode_ref(*b.args(), scale), rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_triton_strided_inputs_and_head_blocks(tri):
    """A cache view with padded rows (only the last dim contiguous), a transposed q_latent, int64 lengths,
    and 20 heads: two head blocks per row, the second partial."""
    g = torch.Generator().manual_seed(7)
    b = _paged_batch(g, 20, 64, 16, 16, *_lens_and_sharing(16))
    padded = torch.randn(*b.cache.shape[:-1], 80 + 8, generator=g)
    padded[..., :80] = b.cache
    q_latent = b.q_latent.transpose(0, 1).contiguous().transpose(0, 1)
    args = (q_latent, b.q_pe, padded[..., :80], b.block_table, b.seq_lens.long(), 0.125)
    torch.testing.assert_close(
        tri.paged_mla_decode_triton(*args), ref.paged_mla_decode_ref(*b.args(), 0.125), rtol=1e-5, atol=1e-5
    )


@needs_interpreter
def test_triton_large_logits(tri):
    """Logits in the hundreds overflow exp without the running max: checks the online rescaling."""
    g = torch.Generator().manual_seed(3)
    b = _paged_batch(g, 4, 64, 16, 4, *_lens_and_sharing(4))
    out = tri.paged_mla_decode_triton(*b.args(), 20.0)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref.paged_mla_decode_ref(*b.args(), 20.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("heads", "c_dim", "p_dim", "block_size", "scale"),
    # 20 heads: two head groups in the C++ kernel, the second partial; scale 20: logits in the hundreds,
    # which overflow exp without the running max.
    [(4, 64, 16, 4, 0.3), (1, 16, 8, 16, 0.3), (20, 64, 16, 16, 0.125), (4, 64, 16, 4, 20.0)],
)
def test_cpu_paths_match_naive_loop(heads, c_dim, p_dim, block_size, scale):
    g = torch.Generator().manual_seed(block_size + heads)
    b = _paged_batch(g, heads, c_dim, p_dim, block_size, *_lens_and_sharing(block_size))
    expected = _naive_decode(b, scale)
    for fn in (ref.paged_mla_decode_ref, cpu.paged_mla_decode_cpu):
        out = fn(*b.args(), scale)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_bf16_matches_naive_loop(path):
    """bf16 in and out, fp32 inside: only the final rounding (half a bf16 ulp, 2^-9 relative) remains."""
    g = torch.Generator().manual_seed(11)
    b = _paged_batch(g, 4, 64, 16, 16, *_lens_and_sharing(16), dtype=torch.bfloat16)
    out = kernels.paged_mla_decode(*b.args(), 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _naive_decode(b, 0.125), rtol=2**-8, atol=1e-5)


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
        torch.testing.assert_close(absorbed[r].double(), naive, rtol=1e-5, atol=1e-5)


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
