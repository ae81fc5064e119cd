from __future__ import annotations

import os

import pytest

# Triton picks interpreter vs compiled when a kernel is decorated; CPU-only test machines need the former.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Python processes the tests start (`python -m ...` from the repository root) must not put the root on
# sys.path: its folders would shadow distributions with the same top-level names (Hugging Face's `kernels`,
# which transformers imports). Installed, they are moelaunch.model, moelaunch.kernels, ...
os.environ.setdefault("PYTHONSAFEPATH", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """A tiny model runs far faster on one thread than with threads fighting other processes for a
    shared machine's cores; outputs do not depend on it."""
    import torch  # here, not at the top: TRITON_INTERPRET must be set before anything loads Triton

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the CPU C++ kernels once, before any test: a first build takes a minute, and inside a
    multi-rank test it would hold one rank while its peers wait in a collective."""
    from moelaunch.kernels import cpu_extension

    if cpu_extension.module() is None:
        pytest.exit("the CPU kernels (kernels/csrc) did not build: see the warning above", returncode=1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI (CI=true) a skipped test fails the run: a suite that is green because it skipped proves
    nothing. Every skip here means a missing tool (Slurm, a compiler) that CI must install."""
    if os.environ.get("CI") != "true":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped and exitstatus == 0:
        reporter.write_line(
            f"CI: {len(skipped)} test(s) skipped (reasons in the summary); failing the run", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
