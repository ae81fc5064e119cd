"""A foreign top-level `kernels` ahead of ours on the path fails at `import launcher` with the fix."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_shadowing_kernels_package_is_named_with_the_fix(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    (shadow / "kernels").mkdir(parents=True)
    (shadow / "kernels" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(REPO)])}
    shadowed = subprocess.run(
        [sys.executable, "-c", "import launcher"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert shadowed.returncode != 0
    assert "shadows it" in shadowed.stderr and "pip uninstall kernels" in shadowed.stderr
    env["PYTHONPATH"] = str(REPO)
    clean = subprocess.run(
        [sys.executable, "-c", "import launcher"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert clean.returncode == 0, clean.stderr
