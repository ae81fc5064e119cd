"""benchmarks/gpu_check.py, the prepared GPU check, on the CPU: every part's code path with tiny shapes
(`--device cpu --quick`, as CI can run it), what needs CUDA saying it was skipped; a task that fails or
outlives its time box is reported and the run goes on; --device cuda without a GPU is refused."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from benchmarks import gpu_check_roofline as roofline
from benchmarks import gpu_check_tables as tables

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    proc = _run("--device", "cpu", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_every_part_prints_its_table_and_the_json_line_parses(quick_run):
    stdout, full = quick_run
    for part, title in gpu_check.TITLES.items():
        assert f"== part {part}: {title} (" in stdout
    for header in ("copy GB/s", "tok/s (min-max)", "of roofline", "busy share", "median ms", "passed"):
        assert header in stdout
    assert "FAILED" not in stdout
    line = json.loads(stdout.strip().splitlines()[-1])
    assert sorted(line["parts"]) == ["1", "2", "3", "4", "5"]
    for part in line["parts"].values():
        assert part["table"] and not part["errors"] and part["elapsed_s"] > 0
    assert line["elapsed_s"] < 120
    # --json has the same tables, unrounded, and every task's raw results.
    assert all(len(full["parts"][n]["table"]) == len(p["table"]) for n, p in line["parts"].items())
    assert set(full["parts"]["2"]["tasks"]) == {"models", "decode-bf16", "decode-fp8", "hf-generate"}


def test_the_decode_table_has_every_system_against_a_roofline(quick_run):
    rows = quick_run[1]["parts"]["2"]["table"]
    seen = {(r["system"], r["dtype"], r["batch"]) for r in rows}
    sizes = gpu_check.Sizes.of(quick=True)
    assert seen == {("moelaunch", d, b) for d in ("bf16", "fp8") for b in sizes.batches} | {
        ("transformers", "bf16", b) for b in sizes.hf_batches
    }
    for r in rows:
        assert r["tok_s"] > 0 and r["roofline_tok_s"] > 0
        assert r["of_roofline"] == pytest.approx(r["tok_s"] / r["roofline_tok_s"])
    models = quick_run[1]["parts"]["2"]["tasks"]["models"]
    assert models["fp8"]["dense"] < models["bf16"]["dense"]  # the FP8 twin's projections are 1 byte


def test_what_needs_cuda_says_it_was_skipped(quick_run):
    stdout, full = quick_run
    assert "skipped: CUDA graphs need CUDA" in stdout
    assert "the profiler's CUDA times need CUDA" in stdout
    assert "skipped: needs a CUDA GPU" in stdout  # the GPU tests ran, and skipped themselves
    profile = full["parts"]["3"]["table"][0]
    assert profile["ops"] > 0 and profile["wall_ms"] > 0
    impls = {r["kernel"]: r["impl"] for r in full["parts"]["4"]["table"]}
    assert impls["fp8_gemm"] == "torch reference"  # no FP8 Triton without CUDA
    assert "Triton skipped (it compiles for CUDA only): the CPU paths ran" in stdout


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_kernel_rows_time_the_triton_paths_and_their_peers(monkeypatch):
    """Part 4 where Triton runs (here interpreted, timings meaningless): the FP8 GEMM's small-M path beside
    the kernel's tiles before it, and MLA decode with its splits, without them, and as before."""
    from benchmarks import gpu_check_kernels as ker

    monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    cpu = torch.device("cpu")
    gemm = {(r["kernel"], r["shape"]): r["impl"] for r in ker.fp8_gemm_rows(cpu, True, 1)}
    assert (
        gemm[("fp8_gemm", "4x1024x256")]
        == "triton, small-M path: 16 rows, A/B swapped, split K 2 (autotuned)"
    )
    assert gemm[("fp8_gemm, before", "4x1024x256")] == "triton, one 16x128 tile, no split"
    assert gemm[("fp8_gemm, before", "64x256x512")] == "triton, one 64x128 tile, no split"
    mla = {r["kernel"]: r["impl"] for r in ker.mla_rows(cpu, True, 1)}
    assert mla == {
        "paged_mla_decode": "triton, 16-head tiles, 2 splits",
        "paged_mla_decode, no split": "triton, 16-head tiles, 1 split",
        "paged_mla_decode_ref": "torch reference",
    }


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(device="cpu", quick=True, part_list=[2], workdir=str(tmp_path))


def test_a_failed_task_reports_its_error_and_log(tmp_path):
    # No model was written into the work folder: the decode task fails, and says why.
    result = gpu_check.spawn("decode-bf16", _args(tmp_path), tmp_path, 60, tmp_path / "log")
    assert "FileNotFoundError" in result["error"]
    assert any("config.json" in line for line in result["log_tail"])


def test_a_task_past_its_time_box_is_stopped_and_says_so(tmp_path):
    start = time.time()
    result = gpu_check.spawn("tests", _args(tmp_path), tmp_path, 1.5, tmp_path / "log")
    assert result["error"].startswith("timed out after 2 s")
    assert time.time() - start < 10


def test_cuda_without_a_gpu_is_refused_with_one_line():
    proc = _run("--device", "cuda", timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "no CUDA GPU is visible here" in proc.stderr


def test_gpu_test_counts_come_from_each_finished_test():
    # pytest -v's lines of a run cut short by the time box: no summary line, the finished tests count.
    output = "\n".join(
        [
            "tests/test_cuda_kernels.py::test_fp8_linear_compiled_matches_reference PASSED [  9%]",
            "tests/test_cuda_kernels.py::test_paged_mla_decode[dtype0] FAILED [ 18%]",
            "tests/test_cuda_kernels.py::test_engine_on_cuda_gives_the_cpu_tokens ERROR [ 27%]",
            "tests/test_cuda_kernels.py::test_the_triton_kernels_are_compiled_not_interpreted SKIPPED [ 36%]",
            "SKIPPED [1] tests/test_cuda_kernels.py:96: needs a CUDA GPU",
        ]
    )
    counts = tables.pytest_counts(output)
    assert {k: counts[k] for k in ("passed", "failed", "errors", "skipped")} == {
        "passed": 1,
        "failed": 1,
        "errors": 1,
        "skipped": 1,
    }
    assert counts["failed_tests"] == [
        "tests/test_cuda_kernels.py::test_paged_mla_decode[dtype0]",
        "tests/test_cuda_kernels.py::test_engine_on_cuda_gives_the_cpu_tokens",
    ]
    assert counts["skip_reasons"] == ["needs a CUDA GPU"]


def test_the_roofline_counts_the_experts_a_batch_picks():
    w = {"dense": 1000, "routed_per_layer": 640, "moe_layers": 2, "n_routed": 64, "top_k": 6}
    w |= {"layers": 3, "latent": 10}
    # Batch 1: the dense bytes, 6 of 64 experts per MoE layer (10 bytes each), 8 cached tokens' latents.
    assert roofline.step_bytes(w, 1, 8) == pytest.approx(1000 + 2 * 6 * 10 + 8 * 3 * 10 * 2)
    # A large batch reads nearly every expert once, shared by all its tokens.
    assert roofline.step_bytes(w, 4096, 0) == pytest.approx(1000 + 2 * 640)
    assert roofline.roofline_tok_s(w, 1, 0, 1.12e-6) == pytest.approx(1.12e3 / 1120)
