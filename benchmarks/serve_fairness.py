"""A chat behind another client's big call: `launch serve` on the bundled model, one client sends 100
prompts x n=16 (1,600 sequences), and a second later a one-prompt chat arrives. The chat as another
client (its own `user`) takes the next free slot; the peer in the same run is the same chat sent with the
big call's `user`, which queues behind it: first come, first served, as every request did before per-client
queues (issue 32: 92 s measured then).

    python -m benchmarks.serve_fairness                      # 3 repeats, engine.max_num_seqs 8
    python -m benchmarks.serve_fairness --max-num-seqs 256 --repeats 5

Prints each run's seconds to the chat's first token and end and the big call's end, then the median and
spread of each way.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.server_process import start_server, stop_server
from moelaunch.cluster.rendezvous import free_port
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT

BIG = {"model": "small", "prompt": ["Reverse hello"] * 100, "n": 16, "max_tokens": 16, "user": "batch"}
CHAT = {"model": "small", "messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 16}


def serve(max_num_seqs: int, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = workdir / "serve.yaml"
    config.write_text(
        f"model: {DEFAULT_CHECKPOINT}\nengine: {{max_num_seqs: {max_num_seqs}}}\n"
        f"server: {{port: {port}, max_queue: 2000}}\njob: {{mode: serve}}\n"
    )
    return start_server(config, port)


def one_run(url: str, chat_user: str) -> tuple[float, float, float]:
    """(chat's first token, chat's end, big call's end), in seconds from each one's start."""
    big: list[float] = []

    def send_big() -> None:
        start = time.monotonic()
        httpx.post(f"{url}/v1/completions", json=BIG, timeout=900).raise_for_status()
        big.append(time.monotonic() - start)

    sender = threading.Thread(target=send_big)
    sender.start()
    time.sleep(1.0)
    start = time.monotonic()
    body = {**CHAT, "user": chat_user, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        # The first event (the assistant role) comes at once; the second brings the first token.
        events = (line for line in response.iter_lines() if line.startswith("data:"))
        next(events), next(events)
        first = time.monotonic() - start
        for _ in events:
            pass
    chat = time.monotonic() - start
    sender.join()
    return first, chat, big[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ways = {"another client": "chat", "same client (first come, first served)": "batch"}
    results: dict[str, list[tuple[float, float, float]]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as workdir:
        proc, url = serve(args.max_num_seqs, Path(workdir))
        try:
            for _ in range(args.repeats):
                for way, user in ways.items():  # alternated, so both see the same machine load
                    first, chat, big = one_run(url, user)
                    results[way].append((first, chat, big))
                    print(
                        f"{way}: chat first token {first:.2f} s, end {chat:.2f} s; big call {big:.2f} s",
                        flush=True,
                    )
        finally:
            stop_server(proc)
    for way, runs in results.items():
        figures = [
            f"{name} {statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"
            for name, values in zip(
                ("chat first token", "chat end", "big call"), zip(*runs, strict=True), strict=True
            )
        ]
        print(f"{way}, median (spread): {', '.join(figures)}")


if __name__ == "__main__":
    main()
