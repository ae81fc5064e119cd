r"""The prepared GPU check of issue 29 (item 6): everything one H100/H200 session should measure, in one
run of under 8 minutes, each part time-boxed so that a failure or a hang costs only its own figures.

    python -m benchmarks.gpu_check [--device cuda] [--quick] [--parts 1,2,3,4,5] [--json OUT]

1. the ceilings: device name, copy bandwidth (bytes read + written), bf16 matmul TFLOP/s;
2. decode tok/s of a random DeepSeek-V3-shaped model (random_checkpoint SHAPES["gpu-check"]: 3.2B
   parameters, ~0.59B read per token) in bf16 and block FP8 (its twin made by the converter), CUDA graphs
   on and off, batch 1 / 32 / 128, 128 in / 128 out, beside transformers' generate in bf16 (batch 1 and
   32), each against a roofline: B x copy bandwidth / the bytes a step at batch B must read;
3. one batch-1 decode step under torch.profiler: GPU-busy share, kernels, launch calls, ops and syncs;
4. kernels.fp8_gemm (4096x7168x16384, and the small-M path at 64x7168x16384 and 4x2048x2048 beside the
   kernel's tiles before it), the grouped MoE GEMM (kernels.moe_grouped_gemm: one launch for 8 experts)
   in bf16 and FP8 beside cuBLAS bf16 on the same shapes, paged MLA decode GB/s (64 and 4 seqs x 128
   heads x 4096 tokens; split-KV on and off, and as before);
5. tests/test_cuda_kernels.py in a subprocess with TRITON_INTERPRET removed, so Triton compiles.

Each task runs in its own process with a timeout (a hung compile or a CUDA fault, which poisons the
process's context, ends only that task); figures are saved as they are measured, so a timeout keeps
them. Cheap parts run first (1, 4, 5, then 2 and 3), so a slow model build cannot starve them. Prints
one table per part with its elapsed time, then one JSON line of the tables' rows (--json OUT writes
them with every task's raw results). Task logs go to --log (default: the work folder, deleted at the
end unless --workdir is given); a failed task's table shows its error and the end of its log.

On a lent GPU machine the image lacks pydantic and xgrammar (which the engine imports): carry them as
wheels (/work/.library/device/README.md). Once, here, in the repository's root (`/.whl/` in
.git/info/exclude):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.5 \
      typing-extensions==4.16.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2

then the device tool's `run` with carry [".whl"], timeout_s 570 and the command

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
    .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 && python3 -m benchmarks.gpu_check
    --json $OUT/gpu_check.json --log $OUT/gpu_check.log

(one line). The tables and the JSON line end the output; $OUT brings back the raw results and the
task logs.

The CPU check (tests/test_gpu_check.py) runs `--device cpu --quick`: tiny shapes, few steps; what needs
CUDA (graphs, the profiler's CUDA times) says it was skipped, and the FP8 and MLA kernels run their CPU
paths (the table's implementation column says which one ran).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import gpu_check_tables as tables

REPO = Path(__file__).resolve().parents[1]
TITLES = {
    1: "ceilings",
    2: "decode tok/s against the roofline",
    3: "one batch-1 decode step (torch.profiler)",
    4: "GEMMs and paged MLA decode",
    5: "GPU tests (Triton compiled)",
}
RUN_ORDER = [1, 4, 5, 2, 3]  # cheap, independent parts first
# Each task's time box on the GPU (seconds); the run as a whole stops at TOTAL_BUDGET.
BUDGETS = {
    "ceilings": 20,
    "fp8-gemm": 50,  # autotuning compiles each config once per shape
    "grouped-gemm": 35,
    "mla-decode": 30,
    "tests": 60,
    # Parts 2 and 3 need the models: drawing 3.2B weights is quick on the GPU, but the converter
    # quantizes on the CPU (~75 s on 2 cores here, so ~15-30 s on the machine's 16).
    "models": 90,
    "decode-bf16": 50,
    "decode-fp8": 75,  # eager FP8 at batch 32 and 128 took ~25 s each on an H200 (issue 29)
    "hf-generate": 30,
    "profile": 35,
}
QUICK_BUDGET = 60  # any one task with --quick
TOTAL_BUDGET = 460  # 7 min 40 s: the tasks start and stop inside 8 minutes


@dataclass(frozen=True)
class Sizes:
    batches: list[int]
    hf_batches: list[int]
    lens: tuple[int, int]  # prompt, output tokens
    rounds: int
    profile_steps: int
    repeats: int  # kernel timings

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        if quick:
            return cls([1, 2, 4], [1, 2], (8, 8), 1, 2, 3)
        return cls([1, 32, 128], [1, 32], (128, 128), 3, 5, 20)


def tasks_of(part: int, parts: list[int]) -> list[str]:
    if part == 1:
        return ["ceilings"]
    if part == 2:
        return ["models", "decode-bf16", "decode-fp8", "hf-generate"]
    if part == 3:
        return ["profile"] if 2 in parts else ["models", "profile"]
    if part == 4:
        return ["fp8-gemm", "grouped-gemm", "mla-decode"]
    return ["tests"]


# ---- the tasks, each run in a child process: `--task NAME` --------------------------------------------


def run_task(name: str, args: argparse.Namespace, save: Callable[[Any], None]) -> None:
    import torch

    device, quick, workdir = torch.device(args.device), args.quick, Path(args.workdir)
    sizes = Sizes.of(quick)
    if name == "tests":
        save(gpu_tests(args.deadline))
    elif name in ("ceilings", "fp8-gemm", "grouped-gemm", "mla-decode"):
        from benchmarks import gpu_check_kernels as ker  # the engine's imports are not needed here

        if name == "ceilings":
            save(ker.ceilings(device, quick))
        else:
            rows = {
                "fp8-gemm": ker.fp8_gemm_rows,
                "grouped-gemm": ker.grouped_rows,
                "mla-decode": ker.mla_rows,
            }
            note = {} if device.type == "cuda" else {"note": "Triton skipped (it compiles for CUDA only)"}
            save({"rows": rows[name](device, quick, sizes.repeats), **note})
    else:
        from benchmarks import gpu_check_decode as dec

        if name == "models":
            save(dec.make_models(workdir, quick, device, fp8=2 in args.part_list))
        elif name in ("decode-bf16", "decode-fp8"):
            dtype = name.removeprefix("decode-")
            dec.decode(workdir, dtype, device, sizes.batches, sizes.lens, sizes.rounds, args.deadline, save)
        elif name == "hf-generate":
            dec.hf_decode(workdir, device, sizes.hf_batches, sizes.lens, sizes.rounds, args.deadline, save)
        else:
            save(dec.profile_step(workdir, device, sizes.lens, sizes.profile_steps))


PER_TEST_TIMEOUT_S = (
    25  # where pytest-timeout is installed (the GPU image): one slow test cannot eat the rest
)


def gpu_tests(deadline: float) -> dict[str, Any]:
    """pytest tests/test_cuda_kernels.py with TRITON_INTERPRET removed, so the kernels compile (the CPU
    C++ kernels are not built: the CPU side of these tests runs the torch paths). Counted from pytest's
    per-test lines, so a run cut short still reports the tests that finished."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MOELAUNCH_CPU_KERNELS"] = "0"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-rs",
        "-p",
        "no:cacheprovider",
        "tests/test_cuda_kernels.py",
    ]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append(f"--timeout={PER_TEST_TIMEOUT_S}")
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(1.0, deadline - time.time())
        )
        output, cut_short = proc.stdout + proc.stderr, False
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        cut_short = True
    print(output)
    result = tables.pytest_counts(output)
    if cut_short:
        result["error"] = "pytest ran out of the time box; the counts are the tests that finished"
    return result


def child_main(args: argparse.Namespace) -> int:
    out = Path(args.task_out)

    def save(result: Any) -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)  # whole files only: the parent may read it after a kill

    try:
        run_task(args.task, args, save)
    except Exception as e:  # reported by the parent, which goes on with the next task
        traceback.print_exc()
        partial = json.loads(out.read_text()) if out.exists() else {}
        save({**partial, "error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


# ---- the parent: time boxes, tables, JSON --------------------------------------------------------------


def spawn(name: str, args: argparse.Namespace, workdir: Path, timeout: float, log: Path) -> dict[str, Any]:
    """Run one task in a child process (its own session, so a timeout kills its subprocesses too)."""
    out = workdir / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "benchmarks.gpu_check", "--task", name, "--task-out", str(out),
        "--device", args.device, "--workdir", str(workdir), "--deadline", str(time.time() + timeout),
        "--parts", ",".join(map(str, args.part_list)), *(["--quick"] if args.quick else []),
    ]  # fmt: skip
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the engine takes a GPU whenever it sees one
    start = time.time()
    log_from = log.stat().st_size if log.exists() else 0
    with log.open("a") as f:
        f.write(f"\n===== task {name} (time box {timeout:.0f} s)\n")
        f.flush()
        child = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            child.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            timed_out = True
    result = json.loads(out.read_text()) if out.exists() else {}
    if timed_out:
        result["error"] = f"timed out after {timeout:.0f} s (figures measured before that are kept)"
    elif child.returncode and "error" not in result:
        result["error"] = f"exited with status {child.returncode}"
    if "error" in result:
        with log.open() as f:
            f.seek(log_from)
            result["log_tail"] = f.read().splitlines()[-12:]
    result["elapsed_s"] = round(time.time() - start, 1)
    return result


def parse_parts(text: str) -> list[int]:
    try:
        parts = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        parts = []
    if not parts or any(p not in TITLES for p in parts):
        raise SystemExit(f"gpu_check: --parts {text!r}: give part numbers 1-5, comma-separated (e.g. 1,4)")
    return parts


def parent_main(args: argparse.Namespace) -> int:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but no CUDA GPU is visible here: run it on a GPU machine, or "
              "check the CPU path with --device cpu --quick", file=sys.stderr)  # fmt: skip
        return 2
    if args.device == "cpu" and not args.quick:
        print("gpu_check: --device cpu needs --quick (the full shapes are a 3.2B model)", file=sys.stderr)
        return 2
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log = Path(args.log) if args.log else workdir / "gpu_check.log"
    started = time.time()
    report: dict[str, Any] = {"device": args.device, "quick": args.quick, "parts": {}}
    try:
        for part in [p for p in RUN_ORDER if p in args.part_list]:
            part_start = time.time()
            results = {}
            for name in tasks_of(part, args.part_list):
                left = TOTAL_BUDGET - (time.time() - started)
                budget = min(QUICK_BUDGET if args.quick else BUDGETS[name], left)
                if budget < 5:
                    results[name] = {"error": "skipped: the run's time budget is spent"}
                    continue
                results[name] = spawn(name, args, workdir, budget, log)
            elapsed = time.time() - part_start
            entry = report["parts"][str(part)] = {"elapsed_s": round(elapsed, 1), "tasks": results}
            text, entry["table"] = tables.render(part, results, report, Sizes.of(args.quick))
            print(f"\n== part {part}: {TITLES[part]} ({elapsed:.1f} s)\n{text}", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["elapsed_s"] = round(time.time() - started, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(report) + "\n")
    print(json.dumps(summary(report)))
    return 0


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The printed JSON line: each part's table rows and errors, 4 significant digits (a GPU session
    returns only the end of the output; --json gets every task's raw results too)."""

    def short(x: Any) -> Any:
        if isinstance(x, float):
            return float(f"{x:.4g}")
        if isinstance(x, dict):
            return {k: short(v) for k, v in x.items()}
        return [short(v) for v in x] if isinstance(x, list) else x

    parts = {
        n: {
            "elapsed_s": p["elapsed_s"],
            "table": [
                short({k: v for k, v in row.items() if k not in ("ms_min", "ms_max")}) for row in p["table"]
            ],
            "errors": {t: r["error"] for t, r in p["tasks"].items() if "error" in r},
        }
        for n, p in report["parts"].items()
    }
    return {k: v for k, v in report.items() if k != "parts"} | {"parts": parts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few steps (the CPU check)")
    p.add_argument("--parts", default="1,2,3,4,5", help="comma-separated subset of the parts 1-5")
    p.add_argument("--json", help="also write the final JSON line to this file")
    p.add_argument("--log", help="append every task's output to this file")
    p.add_argument("--workdir", help="where the models and task results go (kept when given)")
    for hidden in ("--task", "--task-out", "--deadline"):  # a child process's own arguments
        p.add_argument(hidden, help=argparse.SUPPRESS, type=float if hidden == "--deadline" else str)
    args = p.parse_args()
    args.part_list = parse_parts(args.parts)
    return child_main(args) if args.task else parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
