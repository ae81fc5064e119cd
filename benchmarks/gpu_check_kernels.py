"""benchmarks/gpu_check.py, parts 1 and 4: the device's ceilings (copy bandwidth, bf16 matmul rate) and
the kernels package's GEMMs and paged MLA decode beside cuBLAS (torch.matmul / torch.bmm) on the same
shapes. Every figure is the median of timed repeats after warm-up calls (which also absorb Triton's
autotuning), with the min-max spread."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from moelaunch import kernels
from moelaunch.kernels import fp8_reference as fp8_ref
from moelaunch.kernels import mla_decode_reference as mla_ref
from moelaunch.kernels.selection import paged_mla_decode_on_cpu
from moelaunch.kernels.triton_interpreter import sm_count

WARMUP = 3


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> dict[str, float]:
    """Median and min-max of `repeats` timed calls of fn, in ms (CUDA events on a GPU)."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times)}


def rate(timing: dict[str, float], amount: float, unit: str) -> dict[str, float]:
    """timing plus `amount` per second (in 1e12 for TFLOP/s, 1e9 for GB/s) at the median, min and max."""
    scale = 1e12 if unit == "TFLOP/s" else 1e9
    per_s = {k: amount / (timing[k] / 1e3) / scale for k in ("ms", "ms_max", "ms_min")}
    return {**timing, unit: per_s["ms"], "low": per_s["ms_max"], "high": per_s["ms_min"]}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def ceilings(device: torch.device, quick: bool) -> dict[str, Any]:
    """Part 1: a large device-to-device copy (bytes read + written) and a square bf16 matmul on random
    data: the ceilings the other parts are read against."""
    copy_bytes = (16 if quick else 1024) * 2**20
    src = torch.randint(0, 255, (copy_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = rate(time_ms(lambda: dst.copy_(src), device, 10 if quick else 30), 2 * copy_bytes, "GB/s")
    n = 256 if quick else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    matmul = rate(time_ms(lambda: a @ b, device, 5 if quick else 20), 2 * n**3, "TFLOP/s")
    return {
        "device": device_name(device),
        "copy": {"bytes": copy_bytes, **copy},
        "matmul_bf16": {"n": n, **matmul},
    }


def _fp8_weight(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_ref.weight_quant_ref(torch.randn(n, k, device=device) * 0.05)


def _impl(x: torch.Tensor) -> str:
    """Which implementation the FP8 entries run for x (as `selection` decides)."""
    return "triton" if kernels.use_triton(x) else "torch reference"


def _fp8_gemm_impl(x_q: torch.Tensor, n: int) -> str:
    """Which FP8 GEMM path kernels.fp8_gemm takes for x_q's rows (as `fp8_triton` decides)."""
    if not kernels.use_triton(x_q):
        return "torch reference"
    from moelaunch.kernels import fp8_triton as tri

    m, k = x_q.shape
    if m > tri.SMALL_M:
        return "triton, prefill tiles (autotuned)"
    split = tri.split_k_for(m, n, k, sm_count(x_q.device))
    return f"triton, small-M path: 16 rows, A/B swapped, split K {split} (autotuned)"


def fp8_gemm_rows(device: torch.device, quick: bool, repeats: int) -> list[dict[str, Any]]:
    """kernels.fp8_gemm (activations quantized beforehand) against a bf16 torch.matmul of the same
    M x K x N, at a prefill M and at decode Ms (where reading the weight is the cost: GB/s too); where
    Triton runs, each decode M also with one fixed tile of up to 64 rows x 128 columns, the kernel as it
    was before the small-M path (its peer)."""
    shapes = (
        [(64, 256, 512), (4, 1024, 256)]
        if quick
        else [(4096, 7168, 16384), (64, 7168, 16384), (4, 2048, 2048)]
    )
    bf16_name = "cuBLAS bf16" if device.type == "cuda" else "torch bf16"
    rows = []
    for m, k, n in shapes:
        w_q, w_s = _fp8_weight(n, k, device)
        w_bf16 = fp8_ref.weight_dequant_ref(w_q, w_s, out_dtype=torch.bfloat16)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        x_q, x_s = kernels.act_quant(x)
        runs = [
            (
                "fp8_gemm",
                _fp8_gemm_impl(x_q, n),
                w_q,
                lambda x_q=x_q, x_s=x_s, w_q=w_q, w_s=w_s: kernels.fp8_gemm(
                    x_q, x_s, w_q, w_s, torch.bfloat16
                ),
            ),
            (bf16_name, "torch.matmul", w_bf16, lambda x=x, w_bf16=w_bf16: x @ w_bf16.T),
        ]
        if kernels.use_triton(x_q) and m <= 64:
            from moelaunch.kernels import fp8_triton as tri

            before = tri.GemmConfig(tri._gemm_block_m(m), 128, num_warps=4, num_stages=3)
            runs.append(
                (
                    "fp8_gemm, before",
                    f"triton, one {before.block_m}x128 tile, no split",
                    w_q,
                    lambda x_q=x_q, x_s=x_s, w_q=w_q, w_s=w_s, c=before: tri.fp8_gemm_with(
                        x_q, x_s, w_q, w_s, torch.bfloat16, config=c
                    ),
                )
            )
        for name, impl, weight, fn in runs:
            timing = rate(time_ms(fn, device, repeats), 2 * m * n * k, "TFLOP/s")
            weight_gb_s = weight.numel() * weight.element_size() / timing["ms"] / 1e6
            rows.append(
                {"kernel": name, "impl": impl, "shape": f"{m}x{k}x{n}", **timing, "weight_GB/s": weight_gb_s}
            )
    return rows


def grouped_rows(device: torch.device, quick: bool, repeats: int) -> list[dict[str, Any]]:
    """The grouped MoE GEMM: `groups` experts of [N, K] each, M rows split evenly between them (a prefill
    batch's routed rows): kernels.moe_grouped_gemm (one launch for every expert, device offsets) in bf16
    and block FP8 (its activation quantization included, once over all rows), kernels.grouped_linear,
    and one bf16 torch.bmm of the same shapes (cuBLAS on a GPU)."""
    groups, m, k, n = (4, 64, 256, 256) if quick else (8, 4096, 7168, 4096)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(groups, n, k, device=device, dtype=torch.bfloat16) * 0.05
    quantized = [fp8_ref.weight_quant_ref(w[g].float()) for g in range(groups)]
    w_q, w_s = torch.stack([q for q, _ in quantized]), torch.stack([s for _, s in quantized])
    offsets = torch.arange(0, m + 1, m // groups, device=device)
    flops = 2 * m * n * k
    shape = f"{groups} x {m // groups}x{k}x{n}"
    x_b = x.view(groups, m // groups, k)
    grouped_impl = "C++ CPU" if kernels.grouped_linear_on_cpu(x, w) else "torch reference, a GEMM per group"
    timings = {
        ("moe_grouped_gemm bf16", _impl(x)): lambda: kernels.moe_grouped_gemm(x, offsets, w),
        ("moe_grouped_gemm fp8", _impl(x)): lambda: kernels.moe_grouped_gemm(x, offsets, w_q, w_s),
        ("grouped_linear bf16", grouped_impl): lambda: kernels.grouped_linear(x, w, offsets),
        ("cuBLAS bf16" if device.type == "cuda" else "torch bf16", "torch.bmm"): lambda: torch.bmm(
            x_b, w.transpose(1, 2)
        ),
    }
    return [
        {"kernel": name, "impl": impl, "shape": shape, **rate(time_ms(fn, device, repeats), flops, "TFLOP/s")}
        for (name, impl), fn in timings.items()
    ]


def mla_rows(device: torch.device, quick: bool, repeats: int) -> list[dict[str, Any]]:
    """kernels.paged_mla_decode over a bf16 latent cache (blocks of 64 in shuffled order), and its torch
    reference; GB/s counts the cache, queries and outputs once. Where Triton runs, also without the split
    over the sequence and as the kernel was before it (16-head tiles, no split), at the issue's 64
    sequences and at a small decode batch, where one program per row and head tile leaves SMs idle."""
    shapes = [(4, 16, 256)] if quick else [(64, 128, 4096), (4, 128, 4096)]
    rows = []
    for seqs, heads, tokens in shapes:
        rows += _mla_shape_rows(device, seqs, heads, tokens, repeats)
    return rows


def _mla_shape_rows(
    device: torch.device, seqs: int, heads: int, tokens: int, repeats: int
) -> list[dict[str, Any]]:
    c_dim, p_dim, block = 512, 64, 64
    per_seq = tokens // block
    table = torch.randperm(seqs * per_seq, device=device).view(seqs, per_seq).to(torch.int32)
    cache = torch.randn(seqs * per_seq, block, c_dim + p_dim, device=device, dtype=torch.bfloat16)
    q_latent = torch.randn(seqs, heads, c_dim, device=device, dtype=torch.bfloat16)
    q_pe = torch.randn(seqs, heads, p_dim, device=device, dtype=torch.bfloat16)
    seq_lens = torch.full((seqs,), tokens, dtype=torch.int32, device=device)
    args = (q_latent, q_pe, cache, table, seq_lens, (c_dim + p_dim) ** -0.5)
    decode = lambda: kernels.paged_mla_decode(*args)  # noqa: E731
    runs = [
        ("paged_mla_decode", "C++ CPU" if paged_mla_decode_on_cpu(q_latent) else "torch reference", decode)
    ]
    if kernels.use_triton(q_latent):
        from moelaunch.kernels import mla_decode_triton as tri

        tile = tri.heads_per_program(heads, cache.dtype)
        splits = tri.num_splits(seqs, -(-heads // tile), tokens, sm_count(device))
        runs = [("paged_mla_decode", f"triton, {tile}-head tiles, {splits} splits", decode)]
        timed = {(tile, splits)}
        for name, peer_tile in (("no split", tile), ("before", 16)):
            if (peer_tile, 1) not in timed:
                timed.add((peer_tile, 1))
                runs.append(
                    (
                        f"paged_mla_decode, {name}",
                        f"triton, {peer_tile}-head tiles, 1 split",
                        lambda t=peer_tile: tri.paged_mla_decode_split(*args, heads=t, splits=1),
                    )
                )
    timings = [(name, impl, time_ms(fn, device, repeats)) for name, impl, fn in runs]
    reference = time_ms(lambda: mla_ref.paged_mla_decode_ref(*args), device, max(3, repeats // 4))
    timings.append(("paged_mla_decode_ref", "torch reference", reference))
    moved = 2 * (cache.numel() + q_latent.numel() + q_pe.numel() + seqs * heads * c_dim)
    shape = f"{seqs} seqs x {heads} heads x {tokens} tokens"
    return [
        {"kernel": name, "impl": impl, "shape": shape, **rate(timing, moved, "GB/s")}
        for name, impl, timing in timings
    ]
