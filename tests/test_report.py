"""`launch report` on the bundled model: every figure comes from a run (the baseline's accuracy is
`launch eval`'s, int8 holds fewer weight bytes, the baseline compared with itself shows no drift), and
the table, report.json, report.md and report.png are written."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.launcher.cli import main
from moelaunch.measure.report.measure import Entry
from moelaunch.measure.report.methods import METHODS
from moelaunch.measure.report.render import SLOWER, chart, markdown, text_table

pytestmark = pytest.mark.slow

SMALL = ["--n-problems", "12", "--input-len", "24", "--output-len", "8", "--batch", "2"]
REQUIRED = {"method", "latency_s", "throughput_tok_s", "peak_memory_bytes", "accuracy", "mean_abs_logit_diff"}


def test_report_measures_every_method_and_the_baseline_matches_eval(tmp_path, capsys):
    """The whole report as a user runs it (every method, on the bundled model), with small workloads."""
    out = tmp_path / "report"
    assert main(["report", "--out", str(out), *SMALL]) == 0
    table = capsys.readouterr().out
    entries = {e["method"]: e for e in json.loads((out / "report.json").read_text())}
    assert list(entries) == list(METHODS) and all(REQUIRED <= e.keys() for e in entries.values())
    assert all(re.search(rf"^{re.escape(name)}\s", table, re.MULTILINE) for name in entries)

    assert main(["eval", "--n", "12"]) == 0
    eval_accuracy = float(re.search(r"accuracy=([\d.]+) n=12", capsys.readouterr().out).group(1))
    base, int8, fp8 = entries["baseline"], entries["int8"], entries["kv-fp8"]
    assert base["accuracy"] == pytest.approx(eval_accuracy, abs=1e-4)
    # The baseline against its own probes: what is left is run-to-run noise (none expected).
    assert base["greedy_agreement"] == 1.0 and base["mean_abs_logit_diff"] < 1e-5
    assert int8["weights_bytes"] < 0.5 * base["weights_bytes"]
    assert fp8["kv_cache_bytes_per_token"] < 0.5 * base["kv_cache_bytes_per_token"]
    assert 0 < int8["mean_abs_logit_diff"] and int8["greedy_agreement"] <= 1.0
    for e in entries.values():
        assert (
            e["latency_s"] > 0 and e["throughput_tok_s"] > 0 and e["peak_memory_bytes"] > e["weights_bytes"]
        )
        # Medians of 3 runs, with the fastest and slowest beside them.
        assert e["latency_range_s"][0] <= e["latency_s"] <= e["latency_range_s"][1]
        assert e["throughput_range_tok_s"][0] <= e["throughput_tok_s"] <= e["throughput_range_tok_s"][1]
    assert "load average" in table and "median (min-max) of 3 runs" in table
    assert "| int8 |" in (out / "report.md").read_text()
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--n-problems", "1001"], "--n-problems 1001: must be in 1..1000"),
        (["--model", "/nowhere"], "/nowhere"),
        (["--out", "/proc/version"], "--out /proc/version"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda: no CUDA GPU is visible here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA GPU"),
        ),
    ],
)
def test_bad_report_arguments_fail_before_any_method_runs(tmp_path, capsys, args, says):
    assert main(["report", "--out", str(tmp_path / "r"), *args]) == 1
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not (tmp_path / "r" / "report.json").exists()


def entry(method: str, latency: float, rate: float) -> Entry:
    return Entry(method, method, latency, (latency * 0.9, latency * 1.2), rate, (rate * 0.8, rate * 1.1),
                 2**20, 2**19, 100.0, None, 0.0, 1.0, False)  # fmt: skip


def test_a_method_slower_than_the_baseline_is_marked_and_the_chart_draws_the_ranges(tmp_path):
    entries = [entry("baseline", 1.0, 100.0), entry("fast", 0.5, 150.0), entry("slow", 2.0, 50.0)]
    table = text_table(entries).splitlines()
    marked = {line.split()[0]: line.count(SLOWER) for line in table[2:5]}
    assert marked == {"baseline": 0, "fast": 0, "slow": 2}  # latency and throughput both
    assert "0.500 (0.450-0.600)" in table[3] and "150.0 (120.0-165.0)" in table[3]
    assert "| slow | 2.000 (1.800-2.400) slower |" in markdown(entries, {}, "launch report", "setup")
    chart(entries, tmp_path / "r.png", "t")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_report_runs_on_a_model_outside_the_task_family(tmp_path, capsys):
    """`--model DIR` on another checkpoint (a random tiny DeepSeek-V3): no accuracy, the drift columns
    measure quality, and a method that derives a checkpoint (expert pruning) runs on its shapes too."""
    model = add_byte_tokenizer(make_hf_model(tmp_path / "tiny", "v3", num_hidden_layers=2))
    out = tmp_path / "report"
    argv = ["report", "--model", str(model), "--out", str(out), "--methods", "int8", "prune-experts"]
    assert main([*argv, *SMALL]) == 0
    assert "accuracy: n/a (not the bundled task family" in capsys.readouterr().out
    entries = {e["method"]: e for e in json.loads((out / "report.json").read_text())}
    assert list(entries) == ["baseline", "int8", "prune-experts"]
    assert all(e["accuracy"] is None for e in entries.values())
    assert entries["int8"]["mean_abs_logit_diff"] > 0 and entries["baseline"]["greedy_agreement"] == 1.0
