"""`launch bench` smoke test: it runs end to end on tiny sizes and reports every documented key (no
timing assertions: the numbers depend on the machine), plus the metric definitions on fixed times."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moelaunch.launcher.cli import main
from moelaunch.measure.bench.metrics import CaseRun, RequestTiming, summarize
from moelaunch.measure.bench.suite import BenchOptions, build_cases
from moelaunch.measure.random_checkpoint import SHAPES
from moelaunch.model.config import load_args
from moelaunch.model.expert_load_file import read_expert_load

METRICS = {
    "requests", "prompt_tokens", "output_tokens", "seconds", "output_tok_s", "total_tok_s", "decode_tok_s",
    "ttft_ms", "ttft_ms_max", "tpot_ms", "peak_rss_mb",
}  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "model"
    assert main(["bench", "--make-model", str(path)]) == 0
    return path


def test_make_model_refuses_a_directory_that_holds_files(bench_model, capsys):
    """`--make-model checkpoints/small` once replaced the bundled model with random weights."""
    before = {f.name: f.read_bytes() for f in bench_model.iterdir()}
    assert main(["bench", "--make-model", str(bench_model)]) == 1
    assert f"destination {bench_model} exists and is not an empty directory" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in bench_model.iterdir()} == before


def test_bench_model_fits_vllm_cpu_mla(bench_model):
    path = bench_model
    config = json.loads((path / "config.json").read_text())
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert config["hidden_size"] == SHAPES["bench"]["hidden_size"] and (path / "tokenizer.json").exists()


def test_bench_runs_and_reports_every_key(bench_model, tmp_path, capsys):
    argv = [
        "bench",
        "--model",
        str(bench_model),
        "--num-requests",
        "3",
        "--input-len",
        "8",
        "--output-len",
        "4",
    ]
    argv += ["--batch-sizes", "1,2", "--compare", "--hf-batch-size", "2", "--json", str(tmp_path / "r.json")]
    argv += ["--rounds", "2", "--expert-load", "--expert-load-out", str(tmp_path / "load.json")]
    # A peer that fails (a "venv" whose python has no vLLM) is reported, not fatal.
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    argv += ["--vllm-venv", str(tmp_path / "venv")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "r.json").read_text())
    assert "TTFT ms" in out and "moelaunch vs transformers" in out and "vllm: not measured" in out

    cases = {"throughput", "latency-b1", "latency-b2"}
    assert set(result["results"]) == {"moelaunch", "transformers"}
    for system in result["results"].values():
        assert set(system) == cases
        assert all(set(m) == METRICS for m in system.values())
    assert result["results"]["moelaunch"]["latency-b2"]["output_tokens"] == 2 * 4
    assert set(result["ratios"]["transformers"]["latency-b2"]) == {"output_tok_s", "decode_tok_s", "ttft"}
    assert "No module named 'vllm'" in result["systems"]["vllm"]["error"]
    # The routed load over every request this engine ran (warmup and both rounds), in the JSON and the file.
    load = result["systems"]["moelaunch"]["expert_load"]
    written = read_expert_load(tmp_path / "load.json", load_args(bench_model))
    assert written.tokens == load["tokens"] > 0 and list(written.layers) == [int(k) for k in load["counts"]]
    assert "expert load over" in out
    # Two rounds each, kept in full; the table shows each metric's median (here: the mean of two).
    for system, runs in result["rounds"].items():
        assert len(runs) == 2
        ttfts = [run["latency-b2"]["ttft_ms"] for run in runs]
        assert result["results"][system]["latency-b2"]["ttft_ms"] == pytest.approx(sum(ttfts) / 2, abs=1e-3)


def test_metric_definitions():
    # Two requests arriving at t=0: first tokens at 1 s and 2 s, then 10 more tokens every 0.1 s.
    timings = [RequestTiming(0.0, 1.0, 2.0, 5, 11), RequestTiming(0.0, 2.0, 3.0, 7, 11)]
    m = summarize(CaseRun(timings, 4.0, 100.0), batch_size=2)
    assert m["ttft_ms"] == 1500 and m["ttft_ms_max"] == 2000 and m["tpot_ms"] == 100
    assert m["decode_tok_s"] == 20 and m["output_tok_s"] == 5.5 and m["total_tok_s"] == 8.5
    assert summarize(CaseRun(timings, 4.0, 100.0), batch_size=None)["decode_tok_s"] is None


def test_rounds_draw_fresh_prompts():
    # A repeated prompt would hit this engine's prefix cache in a later round (vLLM restarts each round).
    opts = BenchOptions(model="unused", batch_sizes=(1, 8))
    first, second = build_cases(opts, 4096, seed=0), build_cases(opts, 4096, seed=1)
    assert [c.name for c in first] == [c.name for c in second]
    prompts = [{tuple(r.prompt_ids) for r in c.requests} for c in (*first, *second)]
    assert all(not (a & b) for i, a in enumerate(prompts) for b in prompts[i + 1 :])


@pytest.mark.parametrize(
    ("args", "says"),
    [(["--input-len", "100000"], "exceed the model's"),
     (["--vllm-venv", "/nowhere"], "--vllm-venv /nowhere: no bin/python"),
     (["--expert-load-out", "x.json"], "--expert-load-out needs --expert-load"),
     (["--expert-load", "--expert-load-out", "x.json", "--dtype", "float32,bfloat16"], "give one --dtype")],
)  # fmt: skip
def test_bad_bench_options_fail_before_anything_runs(bench_model, capsys, args, says):
    assert main(["bench", "--model", str(bench_model), *args]) == 1
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("dtypes", ["float16", "bfloat16,bfloat16", ""])
def test_dtype_list_names_the_choices(bench_model, capsys, dtypes):
    with pytest.raises(SystemExit):
        main(["bench", "--model", str(bench_model), "--dtype", dtypes])
    assert "give one or more of float32, bfloat16, comma-separated, each once" in capsys.readouterr().err


def test_both_dtypes_run_every_system_in_that_dtype(bench_model, tmp_path, capsys):
    """`--dtype float32,bfloat16`: one run per dtype, each with its tables; transformers loads that dtype
    and vLLM is asked for it with the MLA backend it needs (its AMX backend refuses fp32). The header names
    the CPU and the instruction sets that choose the kernels."""
    specs = tmp_path / "specs"
    specs.mkdir()
    fake = tmp_path / "venv" / "bin" / "python"  # records the spec vLLM would get, then fails
    fake.parent.mkdir(parents=True)
    # (and the platform it names: a venv whose vllm dist-info lacks "+cpu" finds none otherwise)
    device = tmp_path / "device"
    record = f'echo "$VLLM_TARGET_DEVICE" > {device}\ncp "$2" "{specs}/$(ls {specs} | wc -l).json"'
    fake.write_text(f"#!/bin/sh\n{record}\nexit 3\n")
    fake.chmod(0o755)
    argv = ["bench", "--model", str(bench_model), "--workload", "latency", "--batch-sizes", "1"]
    argv += ["--input-len", "8", "--output-len", "2", "--compare", "--vllm-venv", str(fake.parent.parent)]
    assert main([*argv, "--dtype", "float32,bfloat16"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])["dtypes"]
    assert list(result) == ["float32", "bfloat16"] and "\nfloat32:\n" in out and "\nbfloat16:\n" in out
    for dtype, run in result.items():
        assert run["systems"]["moelaunch"]["dtype"] == run["systems"]["transformers"]["dtype"] == dtype
        assert set(run["results"]) == {"moelaunch", "transformers"}
        assert "exited with code 3" in run["systems"]["vllm"]["error"]
    assert device.read_text().strip() == "cpu"
    sent = [json.loads((specs / f"{i}.json").read_text()) for i in range(2)]
    asked = [(s["dtype"], s["attention_backend"]) for s in sent]
    assert asked == [("float32", "CPU_MLA"), ("bfloat16", None)]
    machine = result["float32"]["machine"]
    assert out.startswith(f"machine: {machine['cpu']}, {machine['cpus']} cores (")
    if "avx2" in Path("/proc/cpuinfo").read_text():
        assert "avx2" in machine["flags"]


def test_vllm_script_passes_dtype_and_backend(monkeypatch, tmp_path, capsys):
    """The script that runs inside vLLM's venv hands the dtype and the backend to vllm.LLM."""
    import types

    from moelaunch.measure.bench import vllm_script

    made = []

    class FakeLLM:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.llm_engine = None

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, __version__="0"))
    base = {"model": "m", "max_model_len": 8, "max_num_batched_tokens": 8, "max_num_seqs": 1}
    base |= {"kv_cache_memory": 1, "cases": []}
    for dtype, backend in (("float32", "CPU_MLA"), ("bfloat16", None)):
        spec = tmp_path / f"{dtype}.json"
        spec.write_text(json.dumps({**base, "dtype": dtype, "attention_backend": backend}))
        vllm_script.main(str(spec))
    assert [m["dtype"] for m in made] == ["float32", "bfloat16"]
    assert made[0]["attention_backend"] == "CPU_MLA" and "attention_backend" not in made[1]
