"""Paged MLA decode through the AMX tiles (csrc/mla_decode_amx.h) against float64 softmax references from the
same bf16 inputs, with the bound of the vdpbf16ps path it shares its numerics with (fp32 sums of bf16
products, softmax weights rounded to bf16: tests/test_kernels_bf16_dot.py).

The cases walk what the tile code does differently: pieces of 16 tokens within a block (block sizes 4,
16 and 64), rows longer than one 128-token segment (the accumulator rescaled between segments, with
logits large enough that exp overflows without the running max), 20 heads (a full 16-head task and a
short one), window starts inside a block, int32 and int64 tables.

A CPU without AMX tiles (no amx_bf16 flag, or Linux refusing the tile state) cannot run this code: there
these tests check that "amx" is refused and that the vdpbf16ps or widening path took the call instead.
"""

from __future__ import annotations

import pytest
import torch
from cpu_paths import PATHS_HERE
from error_bounds import assert_within
from test_kernels_mla_decode import U_BF16, _naive_decode, _paged_batch, weighted_spread

from moelaunch.kernels import cpu_extension, mla_decode_cpu, selection
from moelaunch.kernels.cpu_ops import cpu_kernel

HAS_AMX = "amx" in PATHS_HERE
# DeepSeek-V3's latent and rope widths: the shape the tile path takes (multiples of 32).
C_DIM, P_DIM = 512, 64
# Rows of 1 token, exactly a segment, one past it, several segments, and two rows sharing a sequence.
LENGTHS, SHARING = [1, 128, 129, 300, 47, 48], [0, 1, 2, 3, 4, 4]


def _amx_calls() -> int:
    return cpu_extension.require().amx_calls()


def _decode(b, scale: float, starts: list[int] | None, table: torch.Tensor) -> torch.Tensor:
    first = torch.tensor(starts) if starts else None
    return cpu_kernel("paged_mla_decode_cpu")(
        b.q_latent, b.q_pe, b.cache, table, b.seq_lens.long(), scale, first, selection.cpu_isa_path()
    )


@pytest.mark.parametrize("block_size", [4, 16, 64])
@pytest.mark.parametrize("heads", [8, 20])
@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("scale", [576**-0.5, 1.0], ids=["usual", "large-logits"])
def test_amx_decode_matches_exact_softmax(best_path, block_size, heads, window, scale):
    g = torch.Generator().manual_seed(block_size + heads + int(window))
    b = _paged_batch(g, heads, C_DIM, P_DIM, block_size, LENGTHS, SHARING, dtype=torch.bfloat16)
    # Starts inside a block, at a block's first token, and past a segment's length.
    starts = [0, 5, 16, 140, 0, 47] if window else None
    table = b.block_table if heads == 8 else b.block_table.long()
    before = _amx_calls()
    out = _decode(b, scale, starts, table)
    assert _amx_calls() - before == (1 if HAS_AMX else 0)
    exact, bound = _naive_decode(b, scale, starts)
    assert_within(out, exact, bound + U_BF16 * weighted_spread(b, scale, exact, starts))


def test_amx_takes_only_the_shapes_its_tiles_fit(best_path, monkeypatch):
    """Widths that are not multiples of 32 run vdpbf16ps on an AMX CPU, fp32 queries are rounded to bf16
    by the wrapper (a bf16 model's rows), and forcing avx512_bf16 keeps the tiles idle."""
    g = torch.Generator().manual_seed(7)
    odd = _paged_batch(g, 4, 64, 16, 16, [5, 20], [0, 1], dtype=torch.bfloat16)
    deepseek = _paged_batch(g, 4, C_DIM, P_DIM, 16, [5, 20], [0, 1], dtype=torch.bfloat16)

    def calls(b, *, fp32_queries: bool = False) -> int:
        before = _amx_calls()
        q_latent, q_pe = (b.q_latent.float(), b.q_pe.float()) if fp32_queries else (b.q_latent, b.q_pe)
        mla_decode_cpu.paged_mla_decode_cpu(q_latent, q_pe, b.cache, b.block_table, b.seq_lens, 0.1)
        return _amx_calls() - before

    assert calls(odd) == 0
    assert calls(deepseek) == (1 if HAS_AMX else 0)
    assert calls(deepseek, fp32_queries=True) == (1 if HAS_AMX else 0)
    if "avx512_bf16" in PATHS_HERE:
        monkeypatch.setenv("MOELAUNCH_CPU_ISA", "avx512_bf16")
        selection.cpu_isa_path.cache_clear()
        assert calls(deepseek) == 0
    if not HAS_AMX:
        monkeypatch.setenv("MOELAUNCH_CPU_ISA", "amx")
        selection.cpu_isa_path.cache_clear()
        with pytest.raises(ValueError, match="has no amx path"):
            selection.cpu_isa_path()
