"""`launch report` on the bundled model: every figure comes from a run (the baseline's accuracy is
`launch eval`'s, int8 holds fewer weight bytes, the baseline compared with itself shows no drift), and
the table, report.json, report.md and report.png are written."""

from __future__ import annotations

import json
import re

import pytest
import torch

from moelaunch.launcher.cli import main
from moelaunch.measure.report.methods import METHODS

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
