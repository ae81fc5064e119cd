"""Writing tokens' rows into one layer of a paged cache pool, as a custom op that mutates the pool; the
FP8 latent cache's quantizing write (`store_fp8_latent`) and its read back (`read_fp8_latent`).

As plain `pool[layer].view(-1, W).index_copy_(...)` inside a compiled step, the write to a view of a
graph input is functionalized into a copy of the whole layer's pool, twice per layer; as an op that
declares the pool mutated, the compiled step writes in place. Eager calls outside a trace skip the
op's dispatch, as `cpu_ops.cpu_kernel` does (on the CPU they call the C++ store directly).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelaunch.kernels.cpu_ops import cpu_kernel, traced
from moelaunch.kernels.kv_fp8 import dequantize_latent, quantize_latent
from moelaunch.kernels.selection import cache_store_on_cpu


def _store(pool: Tensor, layer: int, slots: Tensor, rows: Tensor) -> None:
    flat = pool[layer].view(-1, pool.shape[-1])
    if flat.dtype.itemsize == 1:  # fp8: index_copy_ has no fp8 kernel; the bytes are the same as uint8
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


_LIBRARY = torch.library.Library("moelaunch", "FRAGMENT")
_LIBRARY.define("store_rows(Tensor(a!) pool, int layer, Tensor slots, Tensor rows) -> ()")
# Every device's implementation; the C++ CPU kernels register a CPU one when they load (csrc/bindings.cpp),
# which the dispatcher prefers there.
torch.library.impl("moelaunch::store_rows", "CompositeExplicitAutograd", lib=_LIBRARY)(_store)


@torch.library.register_fake("moelaunch::store_rows", lib=_LIBRARY)
def _(pool: Tensor, layer: int, slots: Tensor, rows: Tensor) -> None:
    return None


def store_rows(pool: Tensor, layer: int, slots: Tensor, rows: Tensor) -> None:
    """pool [layers, blocks, block_size, W]: rows [N, W] (pool's dtype) into layer `layer` at flat slots
    (block * block_size + offset)."""
    if traced():
        torch.ops.moelaunch.store_rows(pool, layer, slots, rows)
    elif cache_store_on_cpu(pool):
        cpu_kernel("store_rows_cpu")(pool, layer, slots, rows)
    else:
        _store(pool, layer, slots, rows)


def store_fp8_latent(
    pool: Tensor, scales: Tensor, layer: int, slots: Tensor, latent: Tensor, c_dim: int
) -> None:
    """latent [N, C + P] quantized (`kv_fp8.quantize_latent`: c_dim splits the parts) into layer `layer`
    of an fp8 pool at flat slots, each token's two scales into `scales` [layers, blocks, block_size, 2]:
    in one C++ call on the CPU, else in torch."""
    if cache_store_on_cpu(pool):
        cpu_kernel("store_fp8_latent_cpu")(pool, scales, layer, slots, latent, c_dim)
        return
    values, token_scales = quantize_latent(latent, c_dim)
    store_rows(pool, layer, slots, values)
    store_rows(scales, layer, slots, token_scales)


def read_fp8_latent(values: Tensor, scales: Tensor, c_dim: int, dtype: torch.dtype) -> Tensor:
    """`kv_fp8.dequantize_latent`: codes [..., C + P] and their scales [..., 2] as values in dtype, in
    C++ on the CPU (fp32 or bf16), else in torch."""
    if dtype in (torch.float32, torch.bfloat16) and cache_store_on_cpu(values):
        return cpu_kernel("dequantize_latent_cpu")(values, scales, c_dim, dtype == torch.bfloat16)
    return dequantize_latent(values, scales, c_dim, dtype)
