"""Expert-parallel dispatch/combine micro-benchmark: one MoE layer with random weights.

    torchrun --nproc-per-node N -m benchmarks.moe_dispatch [--tokens 256 --hidden 1024 --experts 16 ...]
    python -m benchmarks.moe_dispatch                       # EP=1, no process group

Every rank routes its own --tokens tokens (DP attention style) through the layer, with ep = N ranks
holding n_experts / N experts each (the all-to-all dispatcher; the local one at N = 1). The EP group's
all_to_all and the local expert compute are timed with perf_counter by thin subclasses (benchmark
only), and the rows each all_to_all sends to *other* ranks are counted. Rank 0 prints a per-rank
table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moelaunch.cluster.rendezvous import RankEnv, init_distributed
from moelaunch.model.config import ModelArgs, args_from_hf_config
from moelaunch.model.expert_dispatch import ExpertDispatch, LocalDispatch
from moelaunch.model.moe import MoE
from moelaunch.parallel.expert_parallel import AllToAllDispatch, ExpertPlacement
from moelaunch.parallel.group import Group
from moelaunch.parallel.mesh import MeshShape, ParallelMesh

# The all_to_all calls of one AllToAllDispatch, in call order (none under the local dispatcher).
A2A_CALLS = ("dispatch", "combine")


@dataclass
class TimedGroup(Group):
    """The EP group, recording each all_to_all's duration and the bytes it sends to other ranks."""

    calls: list[tuple[float, int]] = field(default_factory=list)
    counts_seconds: float = 0.0  # the small exchange of per-rank row counts before dispatch

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        start = time.perf_counter()
        out = super().all_to_all(x, send_counts, recv_counts)
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        to_others = sum(send_counts) - send_counts[self.index]  # rows kept here never cross a link
        self.calls.append((time.perf_counter() - start, to_others * row_bytes))
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = super().exchange_counts(send_counts)
        self.counts_seconds += time.perf_counter() - start
        return out

    def reset(self) -> None:
        self.calls, self.counts_seconds = [], 0.0


class TimedMoE(MoE):
    """Adds up the time spent running the local experts on the rows that reach them."""

    expert_seconds = 0.0

    def run_grouped(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        start = time.perf_counter()
        out = super().run_grouped(x_sorted, counts)
        self.expert_seconds += time.perf_counter() - start
        return out


@dataclass
class Sample:
    """One timed forward on one rank."""

    total: float
    experts: float
    a2a_seconds: dict[str, float]  # per A2A_CALLS label, plus "counts" for the row-count exchange
    bytes_out: dict[str, int]

    @property
    def a2a(self) -> float:
        return sum(self.a2a_seconds.values())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16, help="routed experts in all")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--moe-inter", type=int, default=512, help="moe_intermediate_size")
    p.add_argument("--shared-experts", type=int, default=1)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    # One thread per rank by default, so EP=1/2/4 give every rank the same compute resources.
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    return p.parse_args()


def moe_args(a: argparse.Namespace) -> ModelArgs:
    """A DeepSeek-V3 config around the MoE sizes asked for; attention fields are required but unused."""
    cfg = {
        "model_type": "deepseek_v3",
        "vocab_size": 1024,
        "hidden_size": a.hidden,
        "intermediate_size": a.moe_inter,
        "moe_intermediate_size": a.moe_inter,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": a.experts,
        "n_shared_experts": a.shared_experts,
        "num_experts_per_tok": a.topk,
        "routed_scaling_factor": 2.5,
    }
    return args_from_hf_config(cfg)


def build_layer(args: ModelArgs, mesh: ParallelMesh) -> tuple[TimedMoE, TimedGroup]:
    ep = TimedGroup(mesh.ep.ranks, mesh.ep.index, mesh.ep.pg)
    n = args.n_routed_experts
    dispatch: ExpertDispatch = (
        AllToAllDispatch(ExpertPlacement.contiguous(n, ep.size), ep, mesh.tp)
        if ep.size > 1
        else LocalDispatch(n)
    )
    moe = TimedMoE(args, dispatch)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            # Seeded by name (experts by global id), so expert j has the same weights at every EP size.
            p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return moe.eval(), ep


def timed_forwards(moe: TimedMoE, ep: TimedGroup, x: torch.Tensor, warmup: int, iters: int) -> list[Sample]:
    samples = []
    for i in range(warmup + iters):
        if ep.size > 1:
            dist.barrier(group=ep.pg)  # start together, so all_to_all time is not another rank's lag
        ep.reset()
        moe.expert_seconds = 0.0
        start = time.perf_counter()
        moe(x)
        total = time.perf_counter() - start
        if i < warmup:
            continue
        calls = ep.calls or [(0.0, 0)] * len(A2A_CALLS)  # the local dispatcher exchanges nothing
        if len(calls) != len(A2A_CALLS):  # the labels below rely on AllToAllDispatch's call order
            raise RuntimeError(f"expected {len(A2A_CALLS)} all_to_all calls per forward, saw {len(ep.calls)}")
        seconds = {label: s for label, (s, _) in zip(A2A_CALLS, calls, strict=True)}
        sent = {label: b for label, (_, b) in zip(A2A_CALLS, calls, strict=True)}
        samples.append(Sample(total, moe.expert_seconds, {**seconds, "counts": ep.counts_seconds}, sent))
    return samples


def rank_summary(samples: list[Sample], tokens: int) -> dict[str, float]:
    total = sum(s.total for s in samples)
    per_token = {
        f"{label}_bytes_per_token": sum(s.bytes_out[label] for s in samples) / (len(samples) * tokens)
        for label in A2A_CALLS
    }
    per_call = {
        f"{label}_ms_median": 1e3 * statistics.median(s.a2a_seconds[label] for s in samples)
        for label in (*A2A_CALLS, "counts")
    }
    return {
        "layer_ms_median": 1e3 * statistics.median(s.total for s in samples),
        "a2a_ms_median": 1e3 * statistics.median(s.a2a for s in samples),
        "expert_ms_median": 1e3 * statistics.median(s.experts for s in samples),
        "a2a_share": sum(s.a2a for s in samples) / total,
        "expert_share": sum(s.experts for s in samples) / total,
        **per_token,
        **per_call,
    }


def report(a: argparse.Namespace, ep_size: int, ranks: list[dict[str, float]], elem_bytes: int) -> None:
    def mean(key: str) -> float:
        return sum(r[key] for r in ranks) / len(ranks)

    expected = (ep_size - 1) / ep_size * a.topk * a.hidden * elem_bytes
    print(f"EP={ep_size}  tokens/rank={a.tokens} hidden={a.hidden} experts={a.experts} topk={a.topk}")
    print("rank  layer ms  a2a ms  expert ms  a2a %  expert %  dispatch B/tok  combine B/tok")
    for i, r in enumerate(ranks):
        print(
            f"{i:>4}  {r['layer_ms_median']:>8.2f}  {r['a2a_ms_median']:>6.2f}  {r['expert_ms_median']:>9.2f}"
            f"  {100 * r['a2a_share']:>5.1f}  {100 * r['expert_share']:>8.1f}"
            f"  {r['dispatch_bytes_per_token']:>14.0f}  {r['combine_bytes_per_token']:>13.0f}"
        )
    by_call = {label: mean(f"{label}_ms_median") for label in (*A2A_CALLS, "counts")}
    print("all_to_all median ms, mean of ranks: " + ", ".join(f"{k} {v:.2f}" for k, v in by_call.items()))
    print(f"expected bytes/token each way: (N-1)/N * topk * hidden * {elem_bytes} = {expected:.0f}")
    summary = {
        "ep": ep_size,
        "tokens_per_rank": a.tokens,
        "hidden": a.hidden,
        "experts": a.experts,
        "topk": a.topk,
        "moe_inter": a.moe_inter,
        "shared_experts": a.shared_experts,
        "threads_per_rank": a.threads,
        "dispatch_bytes_per_token": mean("dispatch_bytes_per_token"),
        "combine_bytes_per_token": mean("combine_bytes_per_token"),
        "expected_bytes_per_token": expected,
        # The layer finishes when its slowest rank does.
        "layer_ms_median": max(r["layer_ms_median"] for r in ranks),
        "a2a_share": mean("a2a_share"),
        "expert_share": mean("expert_share"),
        "a2a_ms_by_call": by_call,
        "ranks": ranks,
    }
    print(json.dumps(summary))


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    env = RankEnv.from_env()
    init_distributed(env, timeout_s=120)
    # init_distributed creates no process group for a world of one, so EP=1 uses the no-op mesh.
    mesh = ParallelMesh.build(MeshShape(dp=env.world_size)) if env.world_size > 1 else ParallelMesh.single()
    moe, ep = build_layer(moe_args(a), mesh)
    x = torch.randn(a.tokens, a.hidden, generator=torch.Generator().manual_seed(1000 + mesh.rank))
    with torch.inference_mode():
        mine = rank_summary(timed_forwards(moe, ep, x, a.warmup, a.iters), a.tokens)
    ranks = [mine]
    if ep.size > 1:
        ranks = [{} for _ in range(ep.size)]
        dist.all_gather_object(ranks, mine, group=ep.pg)
    if mesh.rank == 0:
        report(a, ep.size, ranks, x.element_size())
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
