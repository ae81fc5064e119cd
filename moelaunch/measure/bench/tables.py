"""Benchmark results as text tables, and the peer ratios."""

from __future__ import annotations

from typing import Any

Results = dict[str, dict[str, dict[str, Any]]]  # system -> case -> metric -> value

COLUMNS = [
    ("requests", "req"),
    ("prompt_tokens", "in tok"),
    ("output_tokens", "out tok"),
    ("seconds", "s"),
    ("output_tok_s", "out tok/s"),
    ("decode_tok_s", "decode tok/s"),
    ("ttft_ms", "TTFT ms"),
    ("tpot_ms", "TPOT ms"),
    ("peak_rss_mb", "peak MB"),
]
OURS = "moelaunch"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:  # the two name columns left-aligned, numbers right-aligned
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in pairs)

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def results_table(results: Results) -> str:
    rows = [
        [system, case, *(_cell(m[key]) for key, _ in COLUMNS)]
        for system, cases in results.items()
        for case, m in cases.items()
    ]
    return _table(["system", "case", *(title for _, title in COLUMNS)], rows)


def ratios(results: Results) -> dict[str, dict[str, dict[str, float | None]]]:
    """peer -> case -> how many times better moelaunch is: ours/peer for rates, peer/ours for TTFT."""

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    ours = results.get(OURS, {})
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for peer, cases in results.items():
        if peer == OURS:
            continue
        out[peer] = {
            case: {
                "output_tok_s": div(ours[case]["output_tok_s"], m["output_tok_s"]),
                "decode_tok_s": div(ours[case]["decode_tok_s"], m["decode_tok_s"]),
                "ttft": div(m["ttft_ms"], ours[case]["ttft_ms"]),
            }
            for case, m in cases.items()
            if case in ours
        }
    return out


def ratios_table(table: dict[str, dict[str, dict[str, float | None]]]) -> str:
    rows = [
        [f"{OURS} vs {peer}", case, _cell(r["output_tok_s"]), _cell(r["decode_tok_s"]), _cell(r["ttft"])]
        for peer, cases in table.items()
        for case, r in cases.items()
    ]
    return _table(["ratio (x better)", "case", "out tok/s", "decode tok/s", "TTFT"], rows)
