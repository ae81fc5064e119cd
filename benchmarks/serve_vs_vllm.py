"""Served comparison with vLLM: `launch serve` and vLLM's OpenAI server on one model, one dtype at a time,
each loaded by the same client (`launch bench serve`'s, streamed /v1/completions, greedy, ignore_eos).

    python -m benchmarks.serve_vs_vllm --model DIR --vllm-venv /tmp/vllm-venv [--dtypes float32,bfloat16]
        [--compile on]

Per dtype: this engine's server, then vLLM's (one compute thread each: vLLM's OpenMP pinned to core 0;
enforce-eager; in fp32 its CPU_MLA backend, which the AMX one refuses), each loaded `--rounds` times
with seeds 1..rounds (64 requests of 64 random tokens in and 64 out, at most 16 in flight, by default).
Prints output tok/s, median TPOT and median TTFT as the median (min-max) of the rounds, the ratio of
the medians, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.server_process import start_server, stop_server, wait_until_healthy
from moelaunch.cluster.rendezvous import free_port
from moelaunch.measure.bench.serve_load import LoadOptions, run_load
from moelaunch.measure.bench.suite import vllm_attention_backend
from moelaunch.measure.machine import machine_line

# Both servers get the same engine limits.
MAX_NUM_SEQS, MAX_BATCHED_TOKENS, KV_CACHE_BYTES, MAX_MODEL_LEN = 64, 2048, 1 << 30, 512


def our_server(model: Path, dtype: str, workdir: Path, compile: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = workdir / f"serve-{dtype}.yaml"
    config.write_text(
        f"model: {model}\ndtype: {dtype}\n"
        f"engine: {{max_num_seqs: {MAX_NUM_SEQS}, max_num_batched_tokens: {MAX_BATCHED_TOKENS}, "
        f"kv_cache_memory: {KV_CACHE_BYTES}, max_model_len: {MAX_MODEL_LEN}, compile: '{compile}'}}\n"
        f"server: {{port: {port}, served_model_name: bench}}\njob: {{mode: serve}}\n"
    )
    return start_server(config, port)


def vllm_server(venv: Path, model: Path, dtype: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    backend = vllm_attention_backend(dtype)
    command = [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "bench", "--dtype", dtype, "--port", str(port),
        "--enforce-eager", "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--seed", "0",
        *(["--attention-backend", backend] if backend else []),
    ]  # fmt: skip
    log_path = workdir / f"vllm-{dtype}.log"
    log = open(log_path, "w")  # noqa: SIM115 - the server's output, kept while it runs
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.Popen(command, stdout=log, stderr=log, env=env)
    return proc, wait_until_healthy(proc, port, log_path)


def load_rounds(url: str, opts: argparse.Namespace) -> list[dict]:
    """One untimed warm-up, then `rounds` loads (seeds 1..rounds)."""
    shape = dict(input_len=opts.input_len, output_len=opts.output_len, max_concurrency=opts.max_concurrency)
    run_load(LoadOptions(url=url, num_prompts=opts.max_concurrency, seed=0, **shape))
    results = []
    for seed in range(1, opts.rounds + 1):
        result = run_load(LoadOptions(url=url, num_prompts=opts.num_prompts, seed=seed, **shape))
        if result["failed"]:
            raise SystemExit(f"{result['failed']} requests failed: {result['errors']}")
        results.append(result)
    return results


def summary(results: list[dict]) -> dict[str, dict[str, float]]:
    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {
        "output_tok_s": spread([r["output_tok_s"] for r in results]),
        "tpot_ms": spread([r["tpot_ms"]["median"] for r in results]),
        "ttft_ms": spread([r["ttft_ms"]["median"] for r in results]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--vllm-venv", type=Path, required=True)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--compile", choices=("auto", "on", "off"), default="auto", help="this server's engine.compile"
    )
    opts = p.parse_args()
    model = opts.model.resolve()
    print(f"machine: {machine_line('cpu')}", flush=True)
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in opts.dtypes.split(","):
            report[dtype] = {}
            for system, start in (
                ("moelaunch", lambda d=dtype: our_server(model, d, Path(tmp), opts.compile)),
                ("vllm", lambda d=dtype: vllm_server(opts.vllm_venv, model, d, Path(tmp))),
            ):
                print(f"{dtype}: {system} serving", flush=True)
                proc, url = start()
                try:
                    report[dtype][system] = summary(load_rounds(url, opts))
                finally:
                    stop_server(proc)
    print(f"\n{'dtype':<9}{'system':<11}{'out tok/s':>26}{'TPOT ms':>24}{'TTFT ms':>26}")
    for dtype, systems in report.items():
        for system, s in systems.items():
            cells = "".join(
                f"{s[k]['median']:>10.1f} ({s[k]['min']:.1f}-{s[k]['max']:.1f})".rjust(w)
                for k, w in (("output_tok_s", 26), ("tpot_ms", 24), ("ttft_ms", 26))
            )
            print(f"{dtype:<9}{system:<11}{cells}")
        ours, theirs = systems["moelaunch"], systems["vllm"]
        ratio = ours["output_tok_s"]["median"] / theirs["output_tok_s"]["median"]
        verdict = "" if ratio >= 1 else ": slower"
        print(f"{dtype:<9}moelaunch / vllm output tok/s {ratio:.2f}x{verdict}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
