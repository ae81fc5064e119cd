"""KV transfer throughput for prefill/decode disaggregation: one prompt's latent cache (DeepSeek-V3's
576 bf16 values per token and layer, 61 layers) read by a decode process from a prefill process, with
Mooncake's transfer engine (TCP, the reads engine/kv_handoff.py plans: one per layer and block), against
torch.distributed gloo send/recv of the same bytes (one message per layer), between two processes on
this machine's loopback.

    python -m benchmarks.kv_transfer                 # a 4,096-token prompt, 5 repeats
    python -m benchmarks.kv_transfer --tokens 16384 --repeats 3

Prints each way's GB/s (1 GB = 1e9 B) per repeat, then the median and the spread.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import statistics
import time

import torch
import torch.distributed as dist

from moelaunch.cluster.rendezvous import free_port
from moelaunch.engine.kv_handoff import CacheEndpoint, KVHandoff, plan_reads
from moelaunch.engine.kv_transport import MooncakeTransport
from moelaunch.measure.machine import machine_line

LAYERS, WIDTH, BLOCK = 61, 576, 64  # DeepSeek-V3's layers and latent width; the engine's GPU block size
DTYPE = torch.bfloat16


def pool(tokens: int) -> torch.Tensor:
    """A cache holding the prompt's blocks, plus the scratch block, as the engine allocates it."""
    return torch.zeros(LAYERS, tokens // BLOCK + 1, BLOCK, WIDTH, dtype=DTYPE)


def endpoint(cache: torch.Tensor, session: str, ptr: int) -> CacheEndpoint:
    row = WIDTH * cache.element_size()
    return CacheEndpoint("mooncake-tcp", session, 0, 0, dict(enumerate(range(LAYERS))), ptr, None,
                         cache.shape[1], BLOCK, row, 0)  # fmt: skip


def prefill_side(tokens: int, port: int, conn) -> None:
    cache = pool(tokens).normal_()
    transport = MooncakeTransport("127.0.0.1", 60)
    conn.send((transport.session, transport.register(cache)))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    while (repeats := conn.recv()) is not None:
        for _ in range(repeats):
            for layer in range(LAYERS):
                dist.send(cache[layer, : tokens // BLOCK], dst=1)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens (a multiple of 64)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tokens = args.tokens - args.tokens % BLOCK
    torch.set_num_threads(1)
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    port = free_port()
    peer = context.Process(target=prefill_side, args=(tokens, port, theirs), daemon=True)
    peer.start()
    session, remote_ptr = mine.recv()
    cache = pool(tokens)
    transport = MooncakeTransport("127.0.0.1", 60)
    transport.register(cache)
    blocks = list(range(tokens // BLOCK))
    handoff = KVHandoff("bench", [0] * tokens, 0, 0, blocks, [endpoint(cache, session, remote_ptr)])
    [reads] = plan_reads(handoff, endpoint(cache, transport.session, cache.data_ptr()), blocks, 0)
    total = sum(reads.lengths)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    print(machine_line("cpu"))
    print(f"one {tokens}-token prompt: {LAYERS} layers x {tokens // BLOCK} blocks = {len(reads.lengths)} "
          f"reads, {total / 1e6:.1f} MB")  # fmt: skip
    rates: dict[str, list[float]] = {"mooncake-tcp": [], "gloo send/recv": []}
    for _ in range(args.repeats):
        started = time.perf_counter()
        transport.read(reads.peer, reads.local, reads.remote, reads.lengths)
        rates["mooncake-tcp"].append(total / (time.perf_counter() - started) / 1e9)
        mine.send(1)
        started = time.perf_counter()
        for layer in range(LAYERS):
            dist.recv(cache[layer, : tokens // BLOCK], src=0)
        rates["gloo send/recv"].append(total / (time.perf_counter() - started) / 1e9)
    mine.send(None)
    dist.destroy_process_group()
    peer.join(60)
    for way, values in rates.items():
        shown = " ".join(f"{v:.2f}" for v in values)
        print(f"{way:<16} GB/s median {statistics.median(values):.2f} (min {min(values):.2f}, max "
              f"{max(values):.2f}; runs {shown})")  # fmt: skip
    ratio = statistics.median(rates["mooncake-tcp"]) / statistics.median(rates["gloo send/recv"])
    verdict = "faster" if ratio > 1 else "SLOWER"
    print(f"mooncake-tcp / gloo: {ratio:.2f}x ({verdict} than the torch.distributed path)")


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
