"""The README's Python example runs as written, from the repository root, on the bundled model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_python_api_example_runs_as_written():
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Python API") :]
    example = section[section.index("```python\n") + len("```python\n") :].split("```")[0]
    done = subprocess.run(
        [sys.executable, "-c", example], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()[-2:]
    assert first.split() == ["46", "stop"]  # 12+34, through the chat template
    assert second.strip()  # the raw continuation: some text


def yaml_blocks(text: str) -> list[str]:
    return [part.split("```")[0] for part in text.split("```yaml\n")[1:]]


def test_the_deployment_files_in_the_readme_plan_as_written(tmp_path):
    """Each deployment file the README shows is one `launch plan` accepts: the bundled-model one on the
    bundled model as it stands, the DeepSeek-V3 one on V3's config (its weights are not here)."""
    from moelaunch.launcher.cli import main

    blocks = yaml_blocks((REPO / "README.md").read_text())
    assert len(blocks) == 3
    v3 = ["--set", f"model={REPO / 'configs/models/deepseek-v3-671b.json'}"]
    v3 += ["--set", "cluster.device=cuda", "--set", "cluster.device_memory_gb=141"]
    for i, block in enumerate(blocks):
        path = tmp_path / f"block{i}.yaml"
        path.write_text(block)
        if "checkpoints/small" in block:
            (tmp_path / "checkpoints").mkdir(exist_ok=True)
            (tmp_path / "checkpoints/small").symlink_to(REPO / "checkpoints/small")
            assert main(["plan", str(path)]) == 0, block
        else:
            assert main(["plan", str(path), *v3]) == 0, block
