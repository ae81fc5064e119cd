"""Building the CPU kernels: a visible line on a first build, and a lock file left by an interrupted build
neither hangs the next run nor is taken from a build in progress."""

from __future__ import annotations

import os
import time

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


def _lock(tmp_path, age_s: float):
    from torch.utils.cpp_extension import _get_build_directory

    name = f"moelaunch_cpu_kernels_{cpu_extension._build_tag()}"
    build_dir = _get_build_directory(name, verbose=False)
    lock = os.path.join(build_dir, "lock")
    open(lock, "w").close()
    os.utime(lock, (time.time() - age_s,) * 2)
    return lock


def test_a_first_build_says_so(fake_build, capsys):
    assert cpu_extension._build() == "module" and len(fake_build) == 1
    err = capsys.readouterr().err
    assert "building the CPU kernels for this machine (first run only" in err and "built in" in err


def test_a_lock_left_by_an_interrupted_build_is_removed(fake_build, tmp_path, capsys):
    lock = _lock(tmp_path, age_s=cpu_extension.STALE_LOCK_S + 60)
    assert cpu_extension._build() == "module"
    assert not os.path.exists(lock) and "left by an interrupted CPU kernel build" in capsys.readouterr().err


def test_a_fresh_lock_is_waited_for_until_it_goes_or_grows_stale(fake_build, tmp_path, capsys, monkeypatch):
    lock = _lock(tmp_path, age_s=5)
    monkeypatch.setattr(cpu_extension, "LOCK_POLL_S", 0.05)
    polls = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:  # the other build finishes after three polls
        polls.append(seconds)
        if len(polls) == 3:
            os.remove(lock)
        real_sleep(seconds)

    monkeypatch.setattr(cpu_extension.time, "sleep", sleep)
    assert cpu_extension._build() == "module" and len(polls) == 3
    assert capsys.readouterr().err.count("waiting for another process building") == 1
    # A builder that died: its lock ages past STALE_LOCK_S while we wait, and is removed then.
    lock = _lock(tmp_path, age_s=cpu_extension.STALE_LOCK_S - 0.1)
    cpu_extension._build.cache_clear()
    assert cpu_extension._build() == "module" and not os.path.exists(lock)
