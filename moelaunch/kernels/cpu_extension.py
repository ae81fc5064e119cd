"""The C++ CPU kernels (csrc/), compiled into one extension module on first use.

Built with torch's extension builder for this machine's CPU (-march=native; about two minutes the first
time, then cached under TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). When there is no
compiler, or MOELAUNCH_CPU_KERNELS=0, `module()` is None and the dispatcher keeps the torch paths.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import threading
import time
import warnings
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import IO

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    "bindings.cpp",
    "mla_decode_cpu.cpp",
    "grouped_linear_cpu.cpp",
    "fused_cpu.cpp",
    "int_linear_cpu.cpp",
    "moe_route_cpu.cpp",
    "rows_cpu.cpp",
    "paged_store_cpu.cpp",
]
# The longest a build of another process is waited for (builds take 1-3 minutes).
BUILD_WAIT_S = 900.0
LOCK_POLL_S = 0.5
# Held (flock) by whichever process builds: the kernel releases it when that process dies, however.
GUARD_FILE = "moelaunch-build.guard"


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        line = next(line for line in lines if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def _build_tag() -> str:
    # -march=native code must not be reused on a machine with other instructions, nor a build of older
    # sources, nor one compiled against another torch: torch writes its include paths (the venv's) into the
    # build, so two venvs sharing one name would rebuild it in turn. The name carries a digest of all three.
    from torch.utils.cpp_extension import include_paths

    digest = hashlib.sha1(" ".join(sorted(cpu_flags())).encode())
    digest.update("\n".join([torch.__version__, *include_paths()]).encode())
    for path in sorted(CSRC.iterdir()):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def _stable_sources(build_dir: Path) -> list[str]:
    """The sources copied into the build directory: torch writes source paths into the build too, so
    building from each checkout's own csrc/ would make two checkouts rebuild in turn."""
    copy = build_dir / "src"
    copy.mkdir(exist_ok=True)
    for path in CSRC.iterdir():
        target = copy / path.name
        if not target.is_file() or target.read_bytes() != path.read_bytes():
            target.write_bytes(path.read_bytes())
    return [str(copy / s) for s in SOURCES]


@cache
def _build() -> ModuleType | None:
    from torch.utils.cpp_extension import _get_build_directory

    name = f"moelaunch_cpu_kernels_{_build_tag()}"
    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir / GUARD_FILE, "w") as guard:
        _hold(guard, build_dir)
        # Builders take the guard first, so a lock torch left here now is one a killed build left: torch
        # would wait on it forever.
        if (build_dir / "lock").exists():
            (build_dir / "lock").unlink()
            print(
                f"moelaunch: removed {build_dir / 'lock'}, left by an interrupted CPU kernel build",
                file=sys.stderr,
            )
        return _compile(name, _stable_sources(build_dir), fresh=not (build_dir / f"{name}.so").is_file())


def _hold(guard: IO[str], build_dir: Path) -> None:
    """Take the build guard, waiting (with a line, at most BUILD_WAIT_S) while another process builds."""
    deadline = time.monotonic() + BUILD_WAIT_S
    announced = False
    while True:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"another process has been building the CPU kernels in {build_dir} for over "
                    f"{BUILD_WAIT_S:g} s: stop it, or set MOELAUNCH_CPU_KERNELS=0 to run without them"
                ) from None
            if not announced:
                print(
                    f"moelaunch: waiting for another process building the CPU kernels ({build_dir})",
                    file=sys.stderr,
                )
                announced = True
            time.sleep(LOCK_POLL_S)


def _compile(name: str, sources: list[str], fresh: bool) -> ModuleType | None:
    from torch.utils.cpp_extension import load

    # A first build takes a minute or two: say so, or a first `launch` looks hung.
    background = threading.current_thread() is not threading.main_thread()
    if fresh:
        meanwhile = "; answering on the slower torch paths meanwhile" if background else "..."
        print(
            f"moelaunch: building the CPU kernels for this machine (first run only, 1-2 minutes){meanwhile}",
            file=sys.stderr,
            flush=True,
        )
    started = time.monotonic()
    try:
        built = load(
            name=name,
            sources=sources,
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
        if fresh:
            then = "; the next steps use them" if background else ""
            print(
                f"moelaunch: CPU kernels built in {time.monotonic() - started:.0f} s{then}", file=sys.stderr
            )
        return built
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch paths
        warnings.warn(
            f"the CPU kernels could not be built ({type(e).__name__}: {e}); decoding uses the slower "
            "torch paths. Install a C++ compiler (g++) and ninja to get them.",
            stacklevel=3,
        )
        return None


def module() -> ModuleType | None:
    """The built kernels, or None when they are switched off or cannot be built. With
    MOELAUNCH_CPU_KERNELS=background, a first build runs in a thread and None answers until it is done
    (the caller takes the torch paths meanwhile: a first chat answers in seconds, not minutes)."""
    mode = os.environ.get("MOELAUNCH_CPU_KERNELS")
    if mode == "0":
        return None
    if mode == "background" and _building_in_background():
        return None
    return _build()


_background: threading.Thread | None = None


def _building_in_background() -> bool:
    """Start the build in a thread unless one ran; whether it is still running."""
    global _background
    if _background is None:
        _background = threading.Thread(target=_build, name="moelaunch-cpu-kernels", daemon=True)
        _background.start()
    return _background.is_alive()


def require() -> ModuleType:
    ext = module()
    if ext is None:
        raise RuntimeError(
            "the CPU kernels are not available (MOELAUNCH_CPU_KERNELS=0, or the build failed): "
            "check kernels.prepare_cpu_kernels() before calling them"
        )
    return ext


def built() -> ModuleType:
    """The kernels for a call the dispatcher has already sent to them (having asked `module()`): the
    environment is not read again on every kernel call, a cost small decode steps feel."""
    ext = _build()
    if ext is None:
        return require()  # its error names the cause
    return ext


def cast_if_needed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, without a call when it already is: at decode sizes even a no-op .to() shows."""
    return t if t.dtype == dtype else t.to(dtype)
