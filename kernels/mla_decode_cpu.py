"""Paged MLA decode on the CPU through a small C++ kernel (csrc/mla_decode_cpu.cpp), built on first use.

The torch reference pads every row's cache into one dense tensor and reads it several times; at batch
64 that copy was most of a decode step. The kernel reads each cached token once, from its block, with
an online softmax. It is compiled with torch's extension builder the first time it is needed (about a
minute; cached under TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) for this machine's CPU.
When there is no compiler, `available()` is False and the dispatcher keeps the reference.
"""

from __future__ import annotations

import hashlib
import warnings
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("csrc") / "mla_decode_cpu.cpp"


def _cpu_tag() -> str:
    # -march=native code must not be reused on a machine with other instructions: the build's name
    # carries the CPU's feature flags.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


@cache
def _extension() -> ModuleType | None:
    from torch.utils.cpp_extension import load

    try:
        return load(
            name=f"moelaunch_mla_decode_cpu_{_cpu_tag()}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # noqa: BLE001 - any build failure means: use the reference
        warnings.warn(
            f"the CPU paged MLA decode kernel could not be built ({type(e).__name__}: {e}); decoding "
            "uses the slower torch reference. Install a C++ compiler (g++) and ninja to get it.",
            stacklevel=3,
        )
        return None


def available() -> bool:
    return _extension() is not None


def paged_mla_decode_cpu(
    q_latent: Tensor, q_pe: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """Same contract as `mla_decode_reference.paged_mla_decode_ref`; needs `available()`."""
    ext = _extension()
    if ext is None:
        raise RuntimeError("the CPU paged MLA decode kernel is not built: check mla_decode_cpu.available()")
    out = ext.paged_mla_decode_cpu(
        q_latent.float().contiguous(),
        q_pe.float().contiguous(),
        cache.contiguous(),
        block_table.contiguous(),
        seq_lens.to(torch.int64).contiguous(),
        float(scale),
    )
    return out.to(q_latent.dtype)
