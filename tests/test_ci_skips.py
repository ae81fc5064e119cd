"""Under CI a skip fails the run unless tests/conftest.py's EXPECTED_SKIPS allows it (with its reason):
run pytest on two small test files, one skipping for an allowed reason and one not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import EXPECTED_SKIPS

SKIPPING = 'import pytest\n\n\ndef test_skips():\n    pytest.skip("{reason}")\n'
XFAILING = (
    'import pytest\n\n\n@pytest.mark.xfail(reason="not working yet")\ndef test_xfails():\n    assert False\n'
)


def _copy_conftest(tests: Path) -> None:
    for name in ("conftest.py", "cpu_paths.py"):  # the second: what conftest imports
        shutil.copy(Path(__file__).with_name(name), tests / name)


def run_ci_pytest(root: Path, ci: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root), "tests"]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_only_the_allowed_skips_pass_under_ci(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    _copy_conftest(tests)
    prefix, needle, _ = EXPECTED_SKIPS[0]
    allowed = tmp_path / prefix.removesuffix("::")
    allowed.write_text(SKIPPING.format(reason=needle))
    done = run_ci_pytest(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:]

    (tests / "test_other.py").write_text(SKIPPING.format(reason=needle))  # an allowed reason, another file
    done = run_ci_pytest(tmp_path)
    assert done.returncode == 1
    assert "CI: unexpected skip tests/test_other.py::test_skips" in done.stdout, done.stdout[-2000:]
    assert "test_cuda_kernels" not in done.stdout.split("unexpected skip", 1)[1].split("\n")[0]


def test_an_xfail_fails_a_ci_run_as_a_skip_does(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    _copy_conftest(tests)
    (tests / "test_xfails.py").write_text(XFAILING)
    done = run_ci_pytest(tmp_path)
    assert done.returncode == 1
    assert "CI: unexpected xfail tests/test_xfails.py::test_xfails: not working yet" in done.stdout, (
        done.stdout
    )
    outside_ci = subprocess.run(  # a developer's run reports it and passes
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "tests"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "CI"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert outside_ci.returncode == 0 and "1 xfailed" in outside_ci.stdout, outside_ci.stdout


def test_outside_ci_every_skip_says_why_without_asking(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    _copy_conftest(tests)
    (tests / "test_ray_like.py").write_text(
        SKIPPING.format(reason="Ray tests run inside a network namespace")
    )
    (tests / "test_xfails.py").write_text(XFAILING)
    done = run_ci_pytest(tmp_path, ci=False)  # -q, no -ra: pytest alone would print "1 skipped" only
    assert done.returncode == 0, done.stdout[-2000:]
    assert "not run, and why" in done.stdout
    assert "1 test(s): Ray tests run inside a network namespace" in done.stdout
    assert "1 test(s): not working yet" in done.stdout
