"""The C++ kernels' instruction-set paths this CPU can run (csrc/cpu_isa.h), from its flags: what the
kernels' build must offer here. Tests force each in turn through the `isa_path` fixture (conftest.py)."""

from __future__ import annotations


def paths_of_this_cpu() -> list[str]:
    flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    paths = ["scalar"]
    if {"avx2", "fma"} <= flags:
        paths.append("avx2")
        if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
            paths.append("avx512")
            if "avx512_bf16" in flags:  # the integer kernels run their avx512 code on it
                paths.append("avx512_bf16")
                if {"amx_tile", "amx_bf16"} <= flags:  # MLA decode's tiles; Linux >= 5.16 grants them
                    paths.append("amx")
    return paths


PATHS_HERE = paths_of_this_cpu()
