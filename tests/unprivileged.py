"""`launch` run where file permissions bind. The tests run as root, whom a file's mode does not stop (the
capabilities CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH): the runs drop those two before starting Python.
Not `setpriv --reuid=nobody`: the interpreter may sit under /root (pyenv), which nobody cannot enter."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DROP = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]

# Every argv through `launch`'s main in one process (one torch import): its exit code and stderr.
RUNNER = """
import contextlib, io, json, sys
from moelaunch.launcher.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def launch_unprivileged(runs: list[list[str]], timeout_s: float = 300) -> list[tuple[int, str]]:
    """(exit code, stderr) of `launch ARGV` for each of runs, as a user that file permissions bind."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root needs setpriv (util-linux) to let file permissions apply")
        prefix = DROP
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*prefix, sys.executable, "-c", RUNNER, json.dumps(runs)],
        capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr  # a traceback escaping main lands here
    return [(code, err) for code, err in json.loads(done.stdout.splitlines()[-1])]
