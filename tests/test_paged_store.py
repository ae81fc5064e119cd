"""The C++ stores into a paged cache pool (csrc/paged_store_cpu.cpp) against their torch references: the
row store against index_copy_, the FP8 latent cache's quantizing store against `kv_fp8.quantize_latent`
and two row stores. The same bytes and scales, bit for bit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import Tensor

from moelaunch.kernels import dequantize_latent, paged_store, quantize_latent
from moelaunch.kernels.cpu_ops import cpu_kernel
from moelaunch.model import PagedLatentCache, load_args

REPO = Path(__file__).resolve().parents[1]
FP8 = torch.float8_e4m3fn


def _pools(layers: int, blocks: int, block_size: int, width: int) -> tuple[Tensor, Tensor]:
    """An fp8 pool and its scales, filled with a marker so that untouched slots show."""
    pool = torch.full((layers, blocks, block_size, width), 0x5A, dtype=torch.uint8).view(FP8)
    return pool, torch.full((layers, blocks, block_size, 2), -7.0)


def _reference_store(pool: Tensor, scales: Tensor, layer: int, slots: Tensor, latent: Tensor, c_dim: int):
    values, token_scales = quantize_latent(latent, c_dim)
    paged_store._store(pool, layer, slots, values)
    paged_store._store(scales, layer, slots, token_scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_the_cpu_row_store_writes_what_index_copy_writes(dtype):
    g = torch.Generator().manual_seed(0)
    got = torch.randn(3, 5, 4, 24, generator=g).to(dtype)
    want = got.clone()
    slots = torch.randperm(20, generator=g)[:7]
    rows = torch.randn(7, 24, generator=g).to(dtype)
    cpu_kernel("store_rows_cpu")(got, 2, slots, rows)
    paged_store._store(want, 2, slots, rows)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("c_dim", "p_dim"), [(512, 64), (40, 8), (37, 11)])  # (37, 11): scalar tails
def test_the_cpu_store_writes_the_references_bytes_and_scales(dtype, c_dim, p_dim):
    g = torch.Generator().manual_seed(c_dim)
    rows = 45
    # Rows from 1e-12 to 1e3 in size (small ones quantize into subnormal codes), a c_kv part of zeros, a
    # row of zeros, a negative zero.
    latent = torch.randn(rows, c_dim + p_dim, generator=g) * torch.logspace(-12, 3, rows)[:, None]
    latent[3, :c_dim] = 0
    latent[4] = 0
    latent[5, 2] = -0.0
    latent = latent.to(dtype)
    slots = torch.randperm(6 * 8, generator=g)[:rows]
    got, got_scales = _pools(3, 6, 8, c_dim + p_dim)
    want, want_scales = got.clone(), got_scales.clone()
    cpu_kernel("store_fp8_latent_cpu")(got, got_scales, 1, slots, latent, c_dim)
    _reference_store(want, want_scales, 1, slots, latent, c_dim)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got_scales, want_scales)


def _every_code_and_the_values_between() -> Tensor:
    """Each finite e4m3 value, each midpoint between neighbours (the ties round to even), and the floats
    just beside the midpoints, both signs; all within +-448, so a part holding 448 has scale 1."""
    codes = torch.arange(0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448 (0x7f is NaN)
    mid = (codes[1:] + codes[:-1]) / 2
    values = torch.cat([codes, mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9))])
    return torch.cat([values, -values])


def test_every_code_midpoint_and_neighbour_rounds_as_torch_rounds():
    values = _every_code_and_the_values_between()
    width = 32  # c_dim 16, p_dim 16: whole vectors and one lane's tail per part
    per_part = width // 2 - 1
    rows = -(-values.numel() // (2 * per_part))
    values = torch.cat([values, torch.zeros(rows * 2 * per_part - values.numel())]).view(rows, 2, per_part)
    latent = torch.cat([torch.full((rows, 2, 1), 448.0), values], dim=-1).view(rows, width)
    pool, scales = _pools(1, rows, 1, width)
    cpu_kernel("store_fp8_latent_cpu")(pool, scales, 0, torch.arange(rows), latent, width // 2)
    assert torch.equal(scales, torch.ones_like(scales))
    assert torch.equal(pool.view(rows, width).view(torch.uint8), latent.to(FP8).view(torch.uint8))


def test_the_caches_stores_take_the_kernels_on_the_cpu(monkeypatch):
    tiny = load_args(REPO / "configs/models/tiny-v3.json")
    args = dataclasses.replace(tiny, kv_lora_rank=40, qk_rope_head_dim=8, num_hidden_layers=1)
    calls = []
    monkeypatch.setattr(paged_store, "cpu_kernel", lambda name: calls.append(name) or cpu_kernel(name))
    cache = PagedLatentCache(args, num_blocks=4, block_size=4, fp8=True)
    latent = torch.randn(5, 48)
    cache.store(0, torch.arange(5), latent)
    want, want_scales = _pools(*cache.pool.shape[:3], 48)
    _reference_store(want, want_scales, 0, torch.arange(5), latent, 40)
    assert calls == ["store_fp8_latent_cpu"]
    assert torch.equal(
        cache.pool[0].view(-1, 48)[:5].view(torch.uint8), want[0].view(-1, 48)[:5].view(torch.uint8)
    )
    assert torch.equal(cache.scales[0].view(-1, 2)[:5], want_scales[0].view(-1, 2)[:5])
    cache = PagedLatentCache(args, num_blocks=4, block_size=4)
    cache.store(0, torch.arange(5), latent)
    assert calls[1:] == ["store_rows_cpu"]
    assert torch.equal(cache.pool[0].view(-1, 48)[:5], latent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("c_dim", "p_dim"), [(512, 64), (37, 11)])
def test_the_cpu_read_of_an_fp8_cache_equals_the_reference(dtype, c_dim, p_dim):
    """Every code (NaN aside) times scales of many sizes, in both widths of the vector loop and its tail."""
    g = torch.Generator().manual_seed(c_dim)
    tokens = 40
    codes = torch.randint(0, 0x7F, (tokens, c_dim + p_dim), generator=g, dtype=torch.uint8)
    codes |= torch.randint(0, 2, codes.shape, generator=g, dtype=torch.uint8) << 7  # both signs
    codes.view(-1)[:0x7F] = torch.arange(0x7F, dtype=torch.uint8)
    values = codes.view(FP8).view(4, 10, -1)  # any leading shape
    scales = torch.rand(4, 10, 2, generator=g) * torch.logspace(-8, 4, 40).view(4, 10, 1)
    got = cpu_kernel("dequantize_latent_cpu")(values, scales, c_dim, dtype == torch.bfloat16)
    assert got.dtype == dtype and got.shape == values.shape
    assert torch.equal(got, dequantize_latent(values, scales, c_dim, dtype))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(pool=torch.zeros(1, 2, 4, 48)), "float8_e4m3fn"),
        (dict(scales=torch.zeros(1, 2, 4, 3)), "scales"),
        (dict(latent=torch.zeros(3, 40)), "latent"),
        (dict(slots=torch.tensor([0, 1, 99])), "out of range"),
        (dict(layer=1), "layer"),
    ],
)
def test_bad_arguments_to_the_fp8_store_are_refused(change, named):
    pool, scales = _pools(1, 2, 4, 48)
    args = dict(pool=pool, scales=scales, layer=0, slots=torch.arange(3), latent=torch.zeros(3, 48), c_dim=40)
    with pytest.raises(RuntimeError, match=named):
        cpu_kernel("store_fp8_latent_cpu")(*(args | change).values())


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(rows=torch.zeros(3, 40)), "rows"),
        (dict(rows=torch.zeros(3, 48, dtype=torch.float64)), "rows"),
        (dict(rows=torch.zeros(3, 48, dtype=torch.int32)), "rows"),  # fp32's size, not its dtype
        (dict(slots=torch.tensor([0, 1, 8])), "out of range"),
        (dict(layer=2), "layer"),
    ],
)
def test_bad_arguments_to_the_row_store_are_refused(change, named):
    args = dict(pool=torch.zeros(2, 2, 4, 48), layer=0, slots=torch.arange(3), rows=torch.zeros(3, 48))
    with pytest.raises(RuntimeError, match=named):
        cpu_kernel("store_rows_cpu")(*(args | change).values())
