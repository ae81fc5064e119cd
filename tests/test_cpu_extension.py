"""Building the CPU kernels: a visible line on a first build; a lock file left by a killed build is
removed at once, and a build in progress is waited for."""

from __future__ import annotations

import fcntl
import os
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moelaunch.kernels import cpu_extension


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """The build step replaced by a stand-in (a real one takes minutes), in an empty extensions dir."""
    import torch.utils.cpp_extension as builder

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls: list[str] = []
    monkeypatch.setattr(builder, "load", lambda name, **kw: calls.append(name) or "module")
    cpu_extension._build.cache_clear()
    yield calls
    cpu_extension._build.cache_clear()  # later tests load the real build again


def _build_dir() -> str:
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(f"moelaunch_cpu_kernels_{cpu_extension._build_tag()}", verbose=False)


def _lock() -> str:
    """torch's lock file, as a build leaves it while it runs (or for good when it is killed)."""
    lock = os.path.join(_build_dir(), "lock")
    open(lock, "w").close()
    return lock


def test_a_first_build_says_so(fake_build, capsys):
    assert cpu_extension._build() == "module" and len(fake_build) == 1
    err = capsys.readouterr().err
    assert "building the CPU kernels for this machine (first run only" in err and "built in" in err


def test_a_lock_left_by_a_killed_build_is_removed_at_once(fake_build, capsys):
    # A real builder, SIGKILLed while it holds the guard and torch's lock: the kernel drops its guard.
    guard = os.path.join(_build_dir(), cpu_extension.GUARD_FILE)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_GUARD, guard, os.path.join(_build_dir(), "lock")], stdout=subprocess.PIPE
    )
    assert holder.stdout.readline() == b"holding\n"
    holder.kill()
    holder.wait()
    started = time.monotonic()
    assert cpu_extension._build() == "module"
    assert time.monotonic() - started < 5
    assert not os.path.exists(os.path.join(_build_dir(), "lock"))
    assert "left by an interrupted CPU kernel build" in capsys.readouterr().err


def test_a_build_in_progress_is_waited_for(fake_build, capsys, monkeypatch):
    guard = open(os.path.join(_build_dir(), cpu_extension.GUARD_FILE), "w")
    fcntl.flock(guard, fcntl.LOCK_EX)  # another builder (flock conflicts across open files, even here)
    lock = _lock()
    monkeypatch.setattr(cpu_extension, "LOCK_POLL_S", 0.05)
    polls = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:  # the other build finishes after three polls
        polls.append(seconds)
        if len(polls) == 3:
            os.remove(lock)
            guard.close()
        real_sleep(seconds)

    monkeypatch.setattr(cpu_extension.time, "sleep", sleep)
    assert cpu_extension._build() == "module" and len(polls) == 3
    err = capsys.readouterr().err
    assert err.count("waiting for another process building") == 1 and "interrupted" not in err


def test_two_checkouts_in_two_venvs_share_one_build(tmp_path):
    """A second checkout of the same sources (a CI clone beside a working tree), run from a second venv
    over the same torch (a tox env beside a project venv), loads the build the first made; going back to
    the first checkout and venv loads it again. Nothing rebuilds in turn: torch's build files name the
    sources and the venv's include paths, so the sources are built from a copy and the name carries the
    include paths' digest."""
    import shutil

    import moelaunch

    ours = cpu_extension.module()
    assert ours is not None, "the CPU kernels must build on the test machines"
    built_at = os.stat(ours.__file__).st_mtime_ns
    checkout = tmp_path / "checkout"
    shutil.copytree(Path(moelaunch.__file__).parent, checkout / "moelaunch")
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120
    )
    # The same torch as this run's, also when this run is itself in a venv (whose packages a venv made
    # from it does not see): the new venv reads this environment's site-packages through a .pth file.
    (new_site,) = (venv / "lib").glob("python3.*/site-packages")
    (new_site / "same_torch.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    first_checkout = Path(moelaunch.__file__).parents[1]
    turns = [(venv / "bin/python", str(venv), checkout), (sys.executable, sys.prefix, first_checkout)]
    for python, prefix_expected, source_root in turns:
        run = subprocess.run(
            [str(python), "-c", LOAD_AND_PRINT],
            env={**os.environ, "PYTHONPATH": str(source_root)},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        prefix, source, built = run.stdout.split()
        assert source.startswith(str(source_root)) and built == ours.__file__
        assert prefix == prefix_expected  # the run was in that venv
        assert "building the CPU kernels" not in run.stderr
    assert os.stat(ours.__file__).st_mtime_ns == built_at, "a checkout or venv rebuilt the extension"


def test_another_torch_gets_its_own_build(fake_build, monkeypatch):
    """A venv with another torch (other include paths baked into the build) has a build of its own, so two
    venvs never rebuild one in turn; the sources compiled are the copy in that build's directory."""
    import torch.utils.cpp_extension as builder

    sources: list[list[str]] = []
    monkeypatch.setattr(builder, "load", lambda name, **kw: sources.append(kw["sources"]) or "module")
    first = cpu_extension._build_tag()
    assert cpu_extension._build() == "module"
    assert all(Path(s).parent == Path(_build_dir()) / "src" for s in sources[0])
    monkeypatch.setattr(builder, "include_paths", lambda *a, **kw: ["/another/venv/torch/include"])
    assert cpu_extension._build_tag() != first


LOAD_AND_PRINT = """
import sys
from moelaunch.kernels import cpu_extension
print(sys.prefix, cpu_extension.__file__, cpu_extension.module().__file__)
"""

HOLD_GUARD = """
import fcntl, sys, time
guard = open(sys.argv[1], "w")
fcntl.flock(guard, fcntl.LOCK_EX)
open(sys.argv[2], "w").close()
print("holding", flush=True)
time.sleep(60)
"""


def test_a_background_build_answers_none_until_it_is_done(fake_build, monkeypatch, capsys):
    """MOELAUNCH_CPU_KERNELS=background (the default chat's): the first call starts the build in a thread
    and the torch paths answer until it is done; then the kernels do."""
    import threading

    import torch.utils.cpp_extension as builder

    release = threading.Event()
    monkeypatch.setattr(builder, "load", lambda name, **kw: release.wait(30) and "module")
    monkeypatch.setattr(cpu_extension, "_background", None)
    monkeypatch.setenv("MOELAUNCH_CPU_KERNELS", "background")
    assert cpu_extension.module() is None and cpu_extension.module() is None  # one build, not waited for
    release.set()
    cpu_extension._background.join(timeout=30)
    assert cpu_extension.module() == "module"
    err = capsys.readouterr().err
    assert "answering on the slower torch paths meanwhile" in err and "the next steps use them" in err


@pytest.mark.slow
def test_a_first_chat_answers_while_the_kernels_build(tmp_path):
    """On a machine that never built the kernels, `launch` answers its first question in seconds: the
    build runs in the background (and is stopped with the chat here)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moelaunch.launcher.cli"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},  # nothing built here yet
        start_new_session=True,  # the build's compilers too, so the test stops them all
    )
    try:
        out, err = proc.communicate("What is 12+34?\n", timeout=60)
    finally:  # the session: launch and whatever the background build still runs (ninja, g++)
        subprocess.run(["pkill", "-9", "-s", str(proc.pid)], check=False)
    took = time.monotonic() - started
    assert proc.returncode == 0, err[-2000:]
    assert "46" in out.split(">>> What is 12+34?")[1].splitlines()[1], out
    assert "answering on the slower torch paths meanwhile" in err
    assert took < 30, f"the first answer came after {took:.0f} s"
