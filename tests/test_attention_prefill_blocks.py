"""Prompt attention in pieces (a chunk's own keys, then earlier keys by segments, merged by their
log-sum-exp) against one masked softmax over every key in float64, on the fused CPU kernel and on the
portable path; and through the model, chunked prefill over a paged cache against independent paths."""

from __future__ import annotations

import pytest
import torch
from error_bounds import assert_within, dot_logit_error, softmax_average_error
from tiny_models import make_hf_model

from moelaunch.model import load_model, prefill_attention
from moelaunch.model.attention import MLA, causal_mask
from moelaunch.model.kv_cache import SparseAttention
from moelaunch.model.weight_spec import WeightSpec

SEGMENT = 37  # earlier keys per piece here: several pieces, the last one partial


@pytest.mark.parametrize("portable", [False, True], ids=["cpu-flash", "portable"])
@pytest.mark.parametrize(
    ("n_queries", "n_keys", "window"),
    [
        (2, 2, None),
        (300, 300, None),  # a fresh prompt: the own square only, past one QUERY_BLOCK
        (45, 200, None),  # a chunk after a cached prefix of several segments
        (60, 200, 50),  # a sliding window: some segments hide whole rows
    ],
)
def test_pieces_merged_equal_one_masked_softmax(n_queries, n_keys, window, portable):
    torch.manual_seed(n_queries + n_keys)
    heads, dim, dv, scale = 3, 24, 16, 0.3
    q, k, v = (
        torch.randn(heads, n_queries, dim),
        torch.randn(heads, n_keys, dim),
        torch.randn(heads, n_keys, dv),
    )
    start = n_keys - n_queries  # the queries' first position
    first = max(0, start - window) if window is not None else 0

    def piece(k_start: int, k_end: int, causal: bool):
        mask = None
        if window is not None:
            mask = prefill_attention.band_mask(start, n_queries, k_start, k_end - k_start, window, q.device)
        ks, vs = k[:, k_start:k_end], v[:, k_start:k_end]
        return prefill_attention.attend(q, ks, vs, scale, causal and mask is None, mask, portable)

    parts = [piece(start, n_keys, causal=True)]
    parts += [piece(a, min(start, a + SEGMENT), causal=False) for a in range(first, start, SEGMENT)]
    out = prefill_attention.merge(parts)

    mask = causal_mask(n_queries, n_keys, q.device, window).double()
    scores = torch.einsum("htd,hsd->hts", q.double(), k.double()) * scale + mask
    expected = torch.einsum("hts,hsv->htv", scores.softmax(dim=-1), v.double())
    bound = torch.stack(
        [
            softmax_average_error(scores[h], dot_logit_error(q[h], k[h], scale), v[h].double())
            for h in range(heads)
        ]
    )
    assert_within(out, expected, bound)


def test_cpu_kernel_attends_in_the_dtype_asked_for():
    """cpu_dtype=bf16 (a bf16 model): q, k and v rounded to bf16, sums in fp32, the result in q's dtype."""
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 40, 32), torch.randn(2, 40, 32), torch.randn(2, 40, 16)
    out, lse = prefill_attention.attend(q, k, v, 0.2, causal=True, cpu_dtype=torch.bfloat16)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    rounded = [t.bfloat16().double() for t in (q, k, v)]
    mask = causal_mask(40, 40, q.device, None).double()
    scores = torch.einsum("htd,hsd->hts", rounded[0], rounded[1]) * 0.2 + mask
    expected = torch.einsum("hts,hsv->htv", scores.softmax(dim=-1), rounded[2])
    # The kernel rounds its softmax weights to bf16 before the second product: 2^-8 of each output.
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2**-7)
    fp32_out, _ = prefill_attention.attend(q, k, v, 0.2, causal=True)
    assert not torch.equal(out, fp32_out)


def test_a_bf16_model_asks_its_prompts_attention_in_bf16(tmp_path, monkeypatch):
    asked = []
    attend = prefill_attention.attend

    def spy(*args, **kwargs):
        asked.append(kwargs.get("cpu_dtype"))
        return attend(*args, **kwargs)

    monkeypatch.setattr(prefill_attention, "attend", spy)
    ids = torch.randint(2, 100, (1, 6))
    path = make_hf_model(tmp_path)
    for dtype, expected in (("bfloat16", torch.bfloat16), ("float32", None)):
        asked.clear()
        model = load_model(WeightSpec(str(path), dtype=dtype))
        model(ids, 0, model.new_paged_cache(1, 16))
        assert asked and set(asked) == {expected}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_hf_model(tmp_path_factory.mktemp("tiny")))


def _chunked(model, ids, chunks, cache):
    pieces, pos = [], 0
    for n in chunks:
        pieces.append(model(ids[:, pos : pos + n], pos, cache))
        pos += n
    return torch.cat(pieces, dim=1)


def test_chunked_prefill_over_segments_equals_one_pass(tiny, monkeypatch):
    """Chunks that read their prefix back from the cache in several segments give the logits of one
    uncached pass (whose attention is a single fused causal call)."""
    monkeypatch.setattr(prefill_attention, "KEY_SEGMENT", 16)
    ids = torch.randint(2, 320, (1, 100), generator=torch.Generator().manual_seed(0))
    chunked = _chunked(tiny, ids, [30, 30, 40], tiny.new_cache(1, 100))
    assert (chunked - tiny(ids)).abs().max().item() <= 1e-4


def test_windowed_chunked_prefill_equals_the_absorbed_masked_path(tiny, monkeypatch):
    """Under a sliding window, the pieces with band masks agree with the absorbed form's one masked
    softmax over every visible key (a separate implementation of the same window)."""
    monkeypatch.setattr(prefill_attention, "KEY_SEGMENT", 16)
    ids = torch.randint(2, 320, (1, 100), generator=torch.Generator().manual_seed(1))
    window = SparseAttention(window=24)
    naive = _chunked(tiny, ids, [30, 30, 40], tiny.new_paged_cache(1, 100, sparse=window))
    tiny.attn_impl = "absorbed"
    try:
        absorbed = _chunked(tiny, ids, [30, 30, 40], tiny.new_paged_cache(1, 100, sparse=window))
    finally:
        tiny.attn_impl = "auto"
    assert (naive - absorbed).abs().max().item() <= 1e-4
    assert (naive - tiny(ids)).abs().max().item() > 1e-3  # the window did change the result


@pytest.mark.parametrize(("dtype", "fp8"), [("float32", False), ("bfloat16", False), ("float32", True)])
def test_prompts_prefilled_together_take_their_keys_from_one_product(
    tmp_path_factory, monkeypatch, dtype, fp8
):
    """Several prompt chunks in one step take their own keys and values from one kv_b product over
    every row (rounded to the cache's dtype first: a bf16 cache under fp32 rows; an fp8 cache's rows read
    back from their slots), instead of each chunk expanding its own latents read back from the cache: the
    same logits, for first chunks and for chunks after a cached prefix; in fp32 also those of each prompt
    alone."""
    path = make_hf_model(tmp_path_factory.mktemp(f"tiny-{dtype}"))
    model = load_model(WeightSpec(str(path), dtype=dtype))
    ids = torch.randint(2, 320, (3, 60), generator=torch.Generator().manual_seed(2))
    products: list[int] = []  # rows of each shared product
    own_keys_values = MLA._own_keys_values
    monkeypatch.setattr(
        MLA,
        "_own_keys_values",
        lambda self, kv, *a: products.append(len(kv)) or own_keys_values(self, kv, *a),
    )
    together = _chunked(model, ids, [25, 35], model.new_paged_cache(3, 60, fp8=fp8))
    assert products == [75] * 3 + [105] * 3  # both steps, every layer
    monkeypatch.setattr(MLA, "_own_keys_values", lambda *a: None)  # each chunk on its own again
    per_chunk = _chunked(model, ids, [25, 35], model.new_paged_cache(3, 60, fp8=fp8))
    assert (together - per_chunk).abs().max().item() <= 1e-4
    if dtype == "float32":
        alone = [
            _chunked(model, ids[i : i + 1], [25, 35], model.new_paged_cache(1, 60, fp8=fp8)) for i in range(3)
        ]
        assert (together - torch.cat(alone)).abs().max().item() <= 1e-4
