"""`launch report`'s outputs from its entries: a text table, report.json, report.md and report.png."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from moelaunch.measure.report.measure import Entry

MIB = 2**20
COLUMNS = [
    # header, how to show an entry's value
    ("method", lambda e: e.method + (" *" if e.approximation else "")),
    ("latency s", lambda e: f"{e.latency_s:.3f}"),
    ("tok/s (batch)", lambda e: f"{e.throughput_tok_s:.1f}"),
    ("peak MiB", lambda e: f"{e.peak_memory_bytes / MIB:.1f}"),
    ("weights MiB", lambda e: f"{e.weights_bytes / MIB:.2f}"),
    ("KV B/token", lambda e: f"{e.kv_cache_bytes_per_token:.0f}"),
    ("accuracy", lambda e: "n/a" if e.accuracy is None else f"{e.accuracy:.3f}"),
    ("mean abs dlogit", lambda e: f"{e.mean_abs_logit_diff:.4f}"),
    ("greedy agree", lambda e: f"{e.greedy_agreement:.3f}"),
]
FOOTNOTE = "* an approximation of attention (it changes what is computed once a sequence outgrows it)"


def rows(entries: list[Entry]) -> list[list[str]]:
    return [[header for header, _ in COLUMNS]] + [[show(e) for _, show in COLUMNS] for e in entries]


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
    panels = [
        ("latency (s), batch 1", [e.latency_s for e in entries]),
        ("throughput (tok/s), batch", [e.throughput_tok_s for e in entries]),
        ("peak memory (MiB)", [e.peak_memory_bytes / MIB for e in entries]),
        (quality, [e.accuracy if quality == "accuracy" else e.greedy_agreement for e in entries]),
    ]
    names = [e.method + (" *" if e.approximation else "") for e in entries]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 0.4 * len(entries) + 1.5), sharey=True)
    for ax, (label, values) in zip(axes, panels, strict=True):
        ax.barh(names, values, color=["#4c72b0" if i else "#dd8452" for i in range(len(values))])
        ax.set_title(label, fontsize=10)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.0f}" if v >= 100 else f" {v:.3g}", va="center", fontsize=8)
        ax.margins(x=0.25)
    axes[0].invert_yaxis()  # the baseline on top; the axes share it, so once
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(entries: list[Entry], path: Path) -> None:
    path.write_text(json.dumps([asdict(e) for e in entries], indent=1) + "\n")
