from __future__ import annotations

import os

import pytest
import torch  # loads no Triton
from cpu_paths import PATHS_HERE

# Triton picks interpreter vs compiled when a kernel is decorated: interpreted only where there is no GPU
# (the CPU machines, CI), so on a GPU machine the CUDA tests run the compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=PATHS_HERE)
def isa_path(request, monkeypatch) -> str:
    """Each instruction-set path this CPU can run (cpu_paths.py), forced in turn through
    MOELAUNCH_CPU_ISA: the best one and every fallback."""
    from moelaunch.kernels import selection

    monkeypatch.setenv("MOELAUNCH_CPU_ISA", request.param)
    selection.cpu_isa_path.cache_clear()
    yield request.param
    selection.cpu_isa_path.cache_clear()


@pytest.fixture
def best_path(monkeypatch) -> str:
    """The best instruction-set path this CPU has, whatever MOELAUNCH_CPU_ISA the environment set."""
    from moelaunch.kernels import selection

    monkeypatch.delenv("MOELAUNCH_CPU_ISA", raising=False)
    selection.cpu_isa_path.cache_clear()
    yield PATHS_HERE[-1]
    selection.cpu_isa_path.cache_clear()


@pytest.fixture(scope="module")
def one_torch_thread():
    """A tiny model runs far faster on one thread than with threads fighting other processes for a
    shared machine's cores; outputs do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Skips CI accepts, each with why: (test id prefix, part of the skip reason). Anything else that skips or
# xfails under CI fails the run: a suite that is green because it skipped proves nothing, and an xfail is a
# skip that ran.
EXPECTED_SKIPS: list[tuple[str, str, str]] = [
    (
        "tests/test_cuda_kernels.py::",
        "needs a CUDA GPU",
        "the compiled Triton kernels run only on a GPU machine; on the CPU they run interpreted elsewhere",
    ),
]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the CPU C++ kernels once, before any test: a first build takes a minute, and inside a
    multi-rank test it would hold one rank while its peers wait in a collective. With
    MOELAUNCH_CPU_KERNELS=0 the whole suite runs the torch paths (what a GPU machine runs) instead."""
    from moelaunch.kernels import cpu_extension

    if os.environ.get("MOELAUNCH_CPU_KERNELS") == "0":
        return
    if cpu_extension.module() is None:
        pytest.exit("the CPU kernels (kernels/csrc) did not build: see the warning above", returncode=1)


def is_expected_skip(nodeid: str, reason: str) -> bool:
    return any(nodeid.startswith(prefix) and needle in reason for prefix, needle, _ in EXPECTED_SKIPS)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI (CI=true) a skip or an xfail that is not in EXPECTED_SKIPS fails the run."""
    if os.environ.get("CI") != "true":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter is not None else {}
    not_run = [*stats.get("skipped", []), *stats.get("xfailed", [])]
    unexpected = [r for r in not_run if not is_expected_skip(r.nodeid, _skip_reason(r))]
    if unexpected and exitstatus == 0:
        for report in unexpected:
            kind = "xfail" if hasattr(report, "wasxfail") else "skip"
            reporter.write_line(f"CI: unexpected {kind} {report.nodeid}: {_skip_reason(report)}", red=True)
        reporter.write_line(
            f"CI: {len(unexpected)} test(s) skipped or xfailed that EXPECTED_SKIPS (tests/conftest.py) does "
            "not allow; failing the run",
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Outside CI, say why tests did not run, even without -ra: a plain `pytest` outside a network
    namespace skips the Ray and Slurm tests, and "12 skipped" alone reads like success."""
    if os.environ.get("CI") == "true":
        return  # CI fails on an unexpected skip instead (pytest_sessionfinish)
    stats = terminalreporter.stats
    reasons: dict[str, int] = {}
    for report in [*stats.get("skipped", []), *stats.get("xfailed", [])]:
        reason = _skip_reason(report).removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("not run, and why")
        for reason, n in sorted(reasons.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{n} test(s): {reason}", yellow=True)


def _skip_reason(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return report.wasxfail
    # a skip's longrepr is (file, line, "Skipped: reason")
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
