"""Short chats' inter-token latency while long prompts arrive: one engine against prefill/decode
disaggregation (a prefill and a decode part, one rank each, local backend), on the same two cores.

`launch bench serve` sends the short chats (Poisson arrivals, streamed) while a thread posts a long
prompt every few seconds; the figure is the short chats' p99 inter-token latency. With one engine a
long prompt's prefill chunks share the steps of every decode in the batch; disaggregated, the prefill
runs on its own thread beside the decode steps.

    python -m benchmarks.disagg_itl --model /tmp/benchm     # `launch bench --make-model /tmp/benchm`
    python -m benchmarks.disagg_itl --model /tmp/benchm --repeats 5 --long-len 3000

Prints each run's p99 and median ITL per way, then the medians and spreads of the p99s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx

from benchmarks.server_process import start_server, stop_server
from moelaunch.cluster.rendezvous import free_port
from moelaunch.measure.machine import machine_line

WAYS = {
    "one engine": "parallel: {tp: 1}\n",
    "disaggregated": "disaggregation: {prefill: {parallel: {tp: 1}}, decode: {parallel: {tp: 1}}}\n",
}


def deployment(workdir: Path, way: str, model: str, port: int, max_model_len: int) -> Path:
    config = workdir / f"{way.replace(' ', '-')}.yaml"
    config.write_text(
        f"model: {model}\n{WAYS[way]}"
        f"engine: {{max_model_len: {max_model_len}, max_num_batched_tokens: 512, "
        "kv_cache_memory: 400000000}\n"
        f"cluster: {{backend: local, device: cpu}}\nserver: {{port: {port}}}\njob: {{mode: serve}}\n"
    )
    return config


def post_long_prompts(url: str, length: int, every_s: float, vocab: int, stop: threading.Event) -> None:
    rng = random.Random(0)
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    while not stop.wait(every_s):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()


def one_run(url: str, args: argparse.Namespace, vocab: int, out: Path) -> dict:
    stop = threading.Event()
    longs = threading.Thread(
        target=post_long_prompts, args=(url, args.long_len, args.long_every_s, vocab, stop)
    )
    longs.start()
    try:
        subprocess.run(
            [sys.executable, "-m", "moelaunch.launcher.cli", "bench", "serve", "--url", url,
             "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
             "--input-len", "32", "--output-len", str(args.output_len), "--json", str(out)],
            check=True, capture_output=True, timeout=1200,
        )  # fmt: skip
    finally:
        stop.set()
        longs.join()
    return json.loads(out.read_text())["itl_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint (`launch bench --make-model DIR` writes one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-len", type=int, default=2000, help="tokens of each long prompt")
    ap.add_argument("--long-every-s", type=float, default=3.0)
    ap.add_argument("--num-prompts", type=int, default=40, help="short chats per run")
    ap.add_argument("--request-rate", type=float, default=2.0, help="short chats per second")
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    print(machine_line("cpu"))
    p99: dict[str, list[float]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for way in WAYS:
            port = free_port()
            config = deployment(workdir, way, args.model, port, args.long_len + 256)
            proc, url = start_server(config, port)
            try:
                for run in range(args.repeats):
                    itl = one_run(url, args, vocab, workdir / f"{way}-{run}.json")
                    p99[way].append(itl["p99"])
                    print(f"{way}: ITL p99 {itl['p99']:.1f} ms, median {itl['median']:.1f} ms", flush=True)
            finally:
                stop_server(proc)
    for way, values in p99.items():
        print(f"{way:<14} ITL p99 median {statistics.median(values):.1f} ms (min {min(values):.1f}, max "
              f"{max(values):.1f})")  # fmt: skip
    ratio = statistics.median(p99["one engine"]) / statistics.median(p99["disaggregated"])
    print(f"disaggregated p99 ITL is {ratio:.2f}x {'better' if ratio > 1 else 'WORSE'} than one engine's")


if __name__ == "__main__":
    main()
