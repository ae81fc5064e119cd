"""benchmarks/gpu_check.py's tables: one per part, from its tasks' results (each a dict, with "error"
when the task failed or ran out of time), plus the rows each table shows, for the JSON line."""

from __future__ import annotations

import re
import statistics
from typing import Any

from benchmarks.gpu_check_roofline import roofline_tok_s, step_bytes

Row = dict[str, Any]


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows])


def _errors(results: dict[str, Any]) -> list[str]:
    lines = []
    for name, r in results.items():
        if "error" in r:
            lines.append(f"  task {name} FAILED: {r['error']}")
            lines += [f"    | {line}" for line in r.get("log_tail", [])[-6:]]
    return lines


def _spread(r: dict[str, float], unit: str, digits: int = 1) -> str:
    return f"{_num(r[unit], digits)} ({_num(r['low'], digits)}-{_num(r['high'], digits)})"


def render(part: int, results: dict[str, Any], report: dict[str, Any], sizes: Any) -> tuple[str, list[Row]]:
    text, rows = {1: _ceilings, 2: _decode, 3: _profile, 4: _kernels, 5: _tests}[part](results, report, sizes)
    return "\n".join([text, *_errors(results)]).strip("\n"), rows


def _ceilings(results: dict[str, Any], report: dict[str, Any], sizes: Any) -> tuple[str, list[Row]]:
    r = results.get("ceilings", {})
    if "copy" not in r:
        return "", []
    row = {
        "device": r["device"],
        "copy_GB/s": r["copy"]["GB/s"],
        "matmul_bf16_TFLOP/s": r["matmul_bf16"]["TFLOP/s"],
    }
    table = _table(
        ["device", "copy GB/s (read + written; min-max)", f"bf16 matmul {r['matmul_bf16']['n']}^3 TFLOP/s"],
        [[r["device"], _spread(r["copy"], "GB/s"), _spread(r["matmul_bf16"], "TFLOP/s")]],
    )
    return table, [row]


def copy_bandwidth(report: dict[str, Any]) -> float | None:
    ceilings = report["parts"].get("1", {}).get("tasks", {}).get("ceilings", {})
    return ceilings.get("copy", {}).get("GB/s")


def _decode(results: dict[str, Any], report: dict[str, Any], sizes: Any) -> tuple[str, list[Row]]:
    weights = results.get("models", {})
    bandwidth = copy_bandwidth(report)
    context = sizes.lens[0] + sizes.lens[1] / 2  # mean cached tokens over the decode
    systems = [
        ("moelaunch", "bf16", "decode-bf16"),
        ("moelaunch", "fp8", "decode-fp8"),
        ("transformers", "bf16", "hf-generate"),
    ]
    rows: list[Row] = []
    notes = []
    for system, dtype, task in systems:
        figures = results.get(task, {}).get("figures", {})
        for mode_note in results.get(task, {}).get("notes", {}).items():
            notes.append(f"  {system} {dtype} {mode_note[0]}: {mode_note[1]}")
        for key, values in figures.items():
            mode, _, batch = key.rpartition(" ")
            batch_size = int(batch.removeprefix("b"))
            w = weights.get(dtype)
            roof = roofline_tok_s(w, batch_size, context, bandwidth) if w and bandwidth else None
            median = statistics.median(values) if values else None
            rows.append({
                "system": system, "dtype": dtype, "mode": mode or "generate", "batch": batch_size,
                "tok_s": median, "min": min(values, default=None), "max": max(values, default=None),
                "rounds": len(values), "roofline_tok_s": roof,
                "of_roofline": median / roof if median and roof else None,
            })  # fmt: skip
    lines = []
    for dtype, w in weights.items():
        if isinstance(w, dict):
            lines.append(
                f"{dtype} checkpoint: {_gb(w['total'])} of weights; a batch-1 step reads "
                f"{_gb(step_bytes(w, 1, context))} (dense {_gb(w['dense'])} + {w['top_k']} of "
                f"{w['n_routed']} experts per MoE layer + the latent cache)"
            )
    lines.append(
        f"{sizes.lens[0]} in / {sizes.lens[1]} out; tok/s = B / mean time per output token, median of "
        "rounds (min-max); roofline = B x copy bandwidth / bytes a step reads"
        + ("" if bandwidth else " (no copy bandwidth: part 1 did not run)")
    )
    table = _table(
        ["system", "dtype", "mode", "batch", "tok/s (min-max)", "rounds", "roofline tok/s", "of roofline"],
        [
            [
                r["system"], r["dtype"], r["mode"], str(r["batch"]),
                f"{_num(r['tok_s'])} ({_num(r['min'])}-{_num(r['max'])})", str(r["rounds"]),
                _num(r["roofline_tok_s"], 0),
                "-" if r["of_roofline"] is None else f"{100 * r['of_roofline']:.2f}%",
            ]
            for r in rows
        ],
    )  # fmt: skip
    return "\n".join([*lines, table, *notes]), rows


def _profile(results: dict[str, Any], report: dict[str, Any], sizes: Any) -> tuple[str, list[Row]]:
    r = results.get("profile", {})
    modes = [m for m in ("eager", "graphs") if m in r]
    columns = [
        ("wall ms", "wall_ms", 2), ("GPU busy ms", "gpu_busy_ms", 2), ("busy share", "gpu_busy_share", 3),
        ("kernels", "kernels", 0), ("launch calls", "launch_calls", 0),
        ("graph launches", "graph_launches", 0), ("ops", "ops", 0), ("syncs", "syncs", 0),
    ]  # fmt: skip
    table = _table(
        ["mode", *(c[0] for c in columns)],
        [[m, *(_num(r[m].get(k), d) for _, k, d in columns)] for m in modes],
    )
    note = f"  {r['note']}" if "note" in r else ""
    head = (
        f"per step, mean of {sizes.profile_steps} steps (wall time unprofiled, kernels profiled); ops and "
        "syncs: one step under StepOps"
    )
    return "\n".join([head, table, note]) if modes else note, [{"mode": m, **r[m]} for m in modes]


def _kernels(results: dict[str, Any], report: dict[str, Any], sizes: Any) -> tuple[str, list[Row]]:
    rows = [
        row
        for task in ("fp8-gemm", "grouped-gemm", "mla-decode")
        for row in results.get(task, {}).get("rows", [])
    ]
    table = _table(
        ["kernel", "implementation", "shape", "median ms", "rate (min-max)", "weight GB/s"],
        [
            [
                r["kernel"], r["impl"], r["shape"], _num(r["ms"], 3),
                _spread(r, "TFLOP/s") + " TFLOP/s" if "TFLOP/s" in r else _spread(r, "GB/s") + " GB/s",
                _num(r.get("weight_GB/s"), 0),
            ]
            for r in rows
        ],
    )  # fmt: skip
    notes = sorted({f"  {r['note']}: the CPU paths ran" for r in results.values() if "note" in r})
    return "\n".join([table, *notes]), rows


def pytest_counts(output: str) -> dict[str, Any]:
    """passed / failed / skipped / errors from `pytest -v`'s per-test lines (complete even when the run
    was cut short), the failed tests' ids and the skip reasons (`-rs`)."""
    outcomes = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", output, re.MULTILINE)
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors")}
    for _, outcome in outcomes:
        key = {"PASSED": "passed", "XPASS": "passed", "SKIPPED": "skipped", "XFAIL": "skipped"}.get(outcome)
        counts[key or ("errors" if outcome == "ERROR" else "failed")] += 1
    failed = [test for test, outcome in outcomes if outcome in ("FAILED", "ERROR")]
    skip_reasons = sorted(set(re.findall(r"^SKIPPED \[\d+\] \S+: (.*)$", output, re.MULTILINE)))
    return {**counts, "failed_tests": failed, "skip_reasons": skip_reasons}


def _tests(results: dict[str, Any], report: dict[str, Any], sizes: Any) -> tuple[str, list[Row]]:
    r = results.get("tests", {})
    if "passed" not in r:
        return "", []
    lines = [
        _table(
            ["passed", "failed", "errors", "skipped"],
            [[str(r[k]) for k in ("passed", "failed", "errors", "skipped")]],
        ),
        *(f"  failed: {t}" for t in r["failed_tests"]),
        *(f"  skipped: {reason}" for reason in r["skip_reasons"]),
    ]
    return "\n".join(lines), [{k: r[k] for k in ("passed", "failed", "errors", "skipped")}]
