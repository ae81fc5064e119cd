"""`launch report`'s outputs from its entries: a text table, report.json, report.md and report.png."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from moelaunch.measure.report.measure import TIMED_RUNS, Entry

MIB = 2**20
SLOWER = "slower"  # marks a median worse than the baseline's


def slower_latency(e: Entry, base: Entry) -> bool:
    return e is not base and e.latency_s > base.latency_s


def slower_throughput(e: Entry, base: Entry) -> bool:
    return e is not base and e.throughput_tok_s < base.throughput_tok_s


def _timing(median: float, span: tuple[float, float], digits: int, slower: bool) -> str:
    lo, hi = span
    return f"{median:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})" + (f" {SLOWER}" if slower else "")


COLUMNS = [
    # header, how to show an entry's value given the baseline's entry
    ("method", lambda e, b: e.method + (" *" if e.approximation else "")),
    ("latency s", lambda e, b: _timing(e.latency_s, e.latency_range_s, 3, slower_latency(e, b))),
    (
        "tok/s (batch)",
        lambda e, b: _timing(e.throughput_tok_s, e.throughput_range_tok_s, 1, slower_throughput(e, b)),
    ),
    ("peak MiB", lambda e, b: f"{e.peak_memory_bytes / MIB:.1f}"),
    ("weights MiB", lambda e, b: f"{e.weights_bytes / MIB:.2f}"),
    ("KV B/token", lambda e, b: f"{e.kv_cache_bytes_per_token:.0f}"),
    ("accuracy", lambda e, b: "n/a" if e.accuracy is None else f"{e.accuracy:.3f}"),
    ("mean abs dlogit", lambda e, b: f"{e.mean_abs_logit_diff:.4f}"),
    ("greedy agree", lambda e, b: f"{e.greedy_agreement:.3f}"),
]
FOOTNOTE = (
    f"Timings: median (min-max) of {TIMED_RUNS} runs; `{SLOWER}`: the median is worse than the baseline's "
    "(the first row).\n* an approximation of attention (it changes what is computed once a sequence "
    "outgrows it)"
)


def rows(entries: list[Entry]) -> list[list[str]]:
    base = entries[0]
    return [[header for header, _ in COLUMNS]] + [[show(e, base) for _, show in COLUMNS] for e in entries]


def text_table(entries: list[Entry]) -> str:
    table = rows(entries)
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in table]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:], FOOTNOTE])


def markdown(entries: list[Entry], failures: dict[str, str], command: str, setup: str) -> str:
    table = rows(entries)
    lines = [f"`{command}`", "", setup, ""]
    lines += ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in table[1:]]
    lines += ["", FOOTNOTE, ""]
    lines += ["| method | what it is |", "|---|---|"] + [f"| {e.method} | {e.what} |" for e in entries]
    lines += [f"\nFailed: {name}: {why}" for name, why in failures.items()]
    return "\n".join(lines) + "\n"


def chart(entries: list[Entry], path: Path, title: str) -> None:
    """Speed and memory bars with the quality beside them, one panel each, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    quality = "accuracy" if all(e.accuracy is not None for e in entries) else "greedy agreement"
    base = entries[0]
    never = [False] * len(entries)
    panels = [
        # title, values, (min, max) per entry or None, which entries are slower than the baseline
        ("latency (s), batch 1", [e.latency_s for e in entries], [e.latency_range_s for e in entries],
         [slower_latency(e, base) for e in entries]),
        ("throughput (tok/s), batch", [e.throughput_tok_s for e in entries],
         [e.throughput_range_tok_s for e in entries], [slower_throughput(e, base) for e in entries]),
        ("peak memory (MiB)", [e.peak_memory_bytes / MIB for e in entries], None, never),
        (quality, [e.accuracy if quality == "accuracy" else e.greedy_agreement for e in entries],
         None, never),
    ]  # fmt: skip
    names = [e.method + (" *" if e.approximation else "") for e in entries]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 0.4 * len(entries) + 1.5), sharey=True)
    for ax, (label, values, spans, slower) in zip(axes, panels, strict=True):
        # The baseline orange, a method slower than it red, the rest blue; whiskers: min-max of the runs.
        colors = ["#dd8452" if i == 0 else "#c44e52" if s else "#4c72b0" for i, s in enumerate(slower)]
        errors = None if spans is None else _whiskers(values, spans)
        ax.barh(names, values, color=colors, xerr=errors, error_kw={"elinewidth": 0.8, "capsize": 2})
        ax.set_title(label + (f" (red: {SLOWER} than the baseline)" if any(slower) else ""), fontsize=9)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.0f}" if v >= 100 else f" {v:.3g}", va="center", fontsize=8)
        ax.margins(x=0.25)
    axes[0].invert_yaxis()  # the baseline on top; the axes share it, so once
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _whiskers(values: list[float], spans: list[tuple[float, float]]) -> list[list[float]]:
    """matplotlib's xerr: distances below and above each value."""
    return [[v - lo for v, (lo, _) in zip(values, spans, strict=True)],
            [hi - v for v, (_, hi) in zip(values, spans, strict=True)]]  # fmt: skip


def write_json(entries: list[Entry], path: Path) -> None:
    path.write_text(json.dumps([asdict(e) for e in entries], indent=1) + "\n")
