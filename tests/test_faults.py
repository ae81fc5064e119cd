"""Faults in a running two-rank job on the local backend (real processes, gloo): a worker SIGKILLed
while loading weights, during prefill or during decode, and a worker slower than the collective
timeout. Each ends within its timeout with one line naming the rank and the cause, leaves no process
behind, and a rerun of the batch finishes every id exactly once with the tokens of an uninterrupted run.

The faults are injected by tests/fault_injection/sitecustomize.py, which every process of the job
loads (PYTHONPATH) and which acts only on the rank MOELAUNCH_TEST_FAULT names."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.launcher import LLM, SamplingParams

pytestmark = pytest.mark.slow

FAULTS = Path(__file__).with_name("fault_injection")
COLLECTIVE_TIMEOUT_S = 8
# From the fault to the job's end: a death is seen at once, a hang after the collective timeout; then
# rank 0's moment to see which worker is at fault (BLAME_WINDOW_S) and the shutdown, on a shared machine.
DETECTION_SLACK_S = 10
PROMPTS = {f"r{i}": f"request {i}" for i in range(8)}
MAX_TOKENS = 16
ERROR = re.compile(r"^launch: error: rank 1 \(pid (\d+)\) (.*)$", re.MULTILINE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return add_byte_tokenizer(make_hf_model(tmp_path_factory.mktemp("faults"), "v3", num_hidden_layers=2))


@pytest.fixture(scope="module")
def uninterrupted(checkpoint) -> dict[str, list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(checkpoint), kv_cache_memory=4_000_000) as llm:
        outs = llm.generate(list(PROMPTS.values()), greedy)
    return {k: o.outputs[0].token_ids for k, o in zip(PROMPTS, outs, strict=True)}


def deployment(tmp_path: Path, checkpoint: Path) -> Path:
    """A tp=2 greedy batch on the local backend, two sequences at a time."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        "".join(json.dumps({"id": k, "prompt": p, "ignore_eos": True}) + "\n" for k, p in PROMPTS.items())
    )
    cfg = {
        "model": str(checkpoint),
        "parallel": {"tp": 2},
        "engine": {"max_num_seqs": 2, "kv_cache_memory": 4_000_000},
        "cluster": {
            "backend": "local",
            "devices_per_node": 2,
            "device": "cpu",
            "timeouts": {"collective_s": COLLECTIVE_TIMEOUT_S},
        },
        "job": {
            "mode": "batch",
            "input": str(inp),
            "output": str(tmp_path / "out.jsonl"),
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
        },
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(config: Path, fault: str | None = None, stamp: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if fault:
        env |= {"PYTHONPATH": str(FAULTS), "MOELAUNCH_TEST_FAULT": fault}
    if stamp:
        env |= {"MOELAUNCH_TEST_FAULT_STAMP": str(stamp)}
    cmd = [sys.executable, "-m", "moelaunch.launcher.cli", str(config)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def processes_using(path: Path) -> list[int]:
    """Live processes whose command line names `path` (a job's workers carry the model path)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(path).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def results(path: Path) -> dict[str, list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r["token_ids"] for r in rows}


@pytest.mark.parametrize(
    ("fault", "says", "some_done"),
    [
        ("load:1", "stopped: killed by SIGKILL", False),
        ("prefill:1", "stopped: killed by SIGKILL", False),
        ("decode:1:40", "stopped: killed by SIGKILL", True),
        (
            f"slow:1:{COLLECTIVE_TIMEOUT_S * 4}",
            f"did not reach a collective within the collective timeout ({COLLECTIVE_TIMEOUT_S} s",
            False,
        ),
    ],
    ids=["sigkill-loading", "sigkill-prefill", "sigkill-decode", "slower-than-timeout"],
)
def test_a_fault_is_one_line_naming_the_rank_and_a_rerun_finishes(
    tmp_path, checkpoint, uninterrupted, fault, says, some_done
):
    config = deployment(tmp_path, checkpoint)
    out = tmp_path / "out.jsonl"
    stamp = tmp_path / "fault_at"
    failed = launch(config, fault, stamp)
    ended = time.time()
    assert failed.returncode == 1, failed.stderr[-3000:]
    errors = ERROR.findall(failed.stderr)
    assert len(errors) == 1 and says in errors[0][1], failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr and "[rank" not in failed.stderr, failed.stderr[-3000:]
    took = ended - float(stamp.read_text())
    limit = (COLLECTIVE_TIMEOUT_S if fault.startswith("slow") else 0) + DETECTION_SLACK_S
    assert took < limit, f"the fault was noticed {took:.1f} s after it happened (allowed {limit} s)"
    assert not processes_using(checkpoint), "a rank outlived the job"
    partial = results(out)
    assert bool(partial) == some_done and len(partial) < len(PROMPTS)

    rerun = launch(config)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert results(out) == uninterrupted
